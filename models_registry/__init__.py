"""Catalogue of supported sparse models, downloads, hardware probe and fit estimates.

Imports neither torch nor Qt (DESIGN.md): the window and the CLI use it before any
engine is loaded.
"""

from .paths import models_dir, set_models_dir, set_offline
from .resolve import demo_model_dir, downloaded_model_dir, resolve_model

# The rest is imported from its module (models_registry.download, .fit, .hardware, .manage,
# .catalogue, .token): huggingface_hub and psutil load only when they are needed.
__all__ = ["demo_model_dir", "downloaded_model_dir", "models_dir", "resolve_model", "set_models_dir",
           "set_offline"]
