"""From a model folder to tensors: the loader, weight files, quantized storage, prepared rows, checkpoint and GGUF converters, the sidecar folder, confined paths."""
