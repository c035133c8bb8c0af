"""TurboSparse-Mixtral (`TurboSparseMixtralForCausalLM`, model_type `turbosparsemixtral`;
PowerInfer/TurboSparse-Mixtral and -Instruct): Mixtral 8x7B sparsified with dReLU experts,
each expert carrying its own neuron predictor (47B parameters, about 4.3B active a token).

From the published config and modeling code (modeling_turbosparsemixtral.py):
- each layer: RMSNorm (`input_layernorm`) -> attention (GQA, no biases, RoPE theta from the
  config, no sliding window in the published config) -> residual -> RMSNorm
  (`post_attention_layernorm`) -> MoE -> residual; untied head;
- the router `block_sparse_moe.gate` [E, d] reads the FFN's normed input (Mixtral routes
  after attention): softmax over all E logits, the top `num_experts_per_tok`, renormalised
  to sum 1 (the same numbers as a softmax over the top-k logits);
- expert e: `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up) [n, d], `w2` (down) [d, n];
  `hidden_act` relu on both w1 and w3 (dReLU): down(relu(w1 x) * relu(w3 x) * mask);
- mask = round(sigmoid(fc2(relu(fc1(x))))) with `experts.{e}.predictor.fc1` [rank_i, d] and
  `fc2` [n, rank_i], no biases, reading the expert's input; rank_i is per layer (896 to
  1344 in the published code, not in config.json: read from the checkpoint's shapes).
The sparse and hybrid modes compute the predicted neurons of the chosen experts, which is
the published forward; the dense mode computes every neuron of them (no masks).
Config parsing is torch-free; the loaders import torch when called.
"""

from __future__ import annotations

from ..config import ConfigFields, ModelConfig
from ..errors import ModelFormatError
from .llama import TENSORS, parse_gated

NAME = "TurboSparse-Mixtral"
SUPPORTS = "TurboSparse-Mixtral mixtures of dReLU experts with their predictors"
ARCHITECTURES = ("TurboSparseMixtralForCausalLM",)
MODEL_TYPES = ("turbosparsemixtral",)

# Attention, norms, embeddings, head: the Llama names. The MoE ("{i}" = layer, "{e}" = expert):
ROUTER = "model.layers.{i}.block_sparse_moe.gate.weight"
EXPERT = "model.layers.{i}.block_sparse_moe.experts.{e}.{part}.weight"  # part: w1 (gate) | w3 (up) | w2 (down)
EXPERT_PREDICTOR = "model.layers.{i}.block_sparse_moe.experts.{e}.predictor.{part}.weight"  # part: fc1 | fc2
# The predictors' rank per layer in the published modeling code (`predictor_dim`, 32 layers);
# with them the parameter count is the published checkpoint's (total_size / 2 = 51,796,250,624).
PUBLISHED_PREDICTOR_RANKS = (896, 896) + (1024,) * 11 + (1088,) + (1024,) * 13 + (1088,) * 4 + (1344,)


def parse(read: ConfigFields, activation_hint: str | None = None) -> ModelConfig:
    """config.json -> ModelConfig (torch-free). `hidden_act` relu means dReLU here (relu on
    both w1 and w3, as the modeling code applies act_fn to each)."""
    activation = read.activation("hidden_act", default="relu")
    if activation != "relu":
        raise ModelFormatError(f"config.json: TurboSparse-Mixtral with hidden_act {activation!r} is not supported "
                               "(its experts are dReLU: hidden_act relu)")
    experts = read.int("num_local_experts")
    active = read.int("num_experts_per_tok")
    if active > experts:
        raise ModelFormatError(f"config.json: {active} active experts out of {experts}")
    return parse_gated(read, "turbosparsemixtral", "drelu", family="turbosparsemixtral",
                       model_type="turbosparsemixtral", num_experts=experts, experts_per_token=active,
                       router_softmax=True, router_input="ffn",
                       expert_predictor_ranks=PUBLISHED_PREDICTOR_RANKS
                       if read.int("num_hidden_layers") == len(PUBLISHED_PREDICTOR_RANKS) else ())


# ------------------------------------------------------------------------ tensors
def load_globals(conv, cpu, head):
    from .common import load_gated_globals

    return load_gated_globals(conv, TENSORS, cpu, head)


def predictor_ranks(source, config: ModelConfig) -> list[int] | None:
    """Each layer's predictor rank from the checkpoint's shapes (expert 0's fc1), or None
    when the checkpoint carries no predictors."""
    name = EXPERT_PREDICTOR.format(i=0, e=0, part="fc1")
    if not source.has(name):
        return None
    return [int(source.shape(EXPERT_PREDICTOR.format(i=i, e=0, part="fc1"))[0]) for i in range(config.num_layers)]


def load_predictors(conv, i: int, where):
    """Layer i's expert predictors (engine.model.moe.ExpertPredictors), shape-checked."""
    from engine.model.moe import ExpertPredictors

    cfg = conv.config
    d, n, src = cfg.hidden_size, cfg.intermediate_size, conv.source
    name = EXPERT_PREDICTOR.format(i=i, e=0, part="fc1")
    if not src.has(name):
        raise ModelFormatError(f"the checkpoint has no {name}: TurboSparse-Mixtral carries one predictor per expert")
    rank = int(src.shape(name)[0])
    fc1 = [conv.get(EXPERT_PREDICTOR.format(i=i, e=e, part="fc1"), (rank, d), where) for e in range(cfg.num_experts)]
    fc2 = [conv.get(EXPERT_PREDICTOR.format(i=i, e=e, part="fc2"), (n, rank), where) for e in range(cfg.num_experts)]
    return ExpertPredictors(fc1, fc2)


def load_experts(conv, i: int, where):
    """Layer i's experts as stacked gate (w1), up (w3), down_t (w2 transposed) [E, n, d]."""
    from .common import load_expert_stacks

    return load_expert_stacks(conv, i, where, EXPERT, ("w1", "w3", "w2"))


def load_layer(conv, i: int, where, ffn_where=None):
    """One layer. The experts' predictors are read where the FFN is staged for the tiered
    runtime (`ffn_where`: the sparse and hybrid modes, which compute what they predict); the
    dense mode computes every neuron and reads none."""
    from engine.model.moe import DenseMoe

    from .common import load_gated_layer

    cfg = conv.config
    conv_skip = conv.skip_ffn
    conv.skip_ffn = True  # the Llama loader's dense FFN does not exist here
    try:
        layer = load_gated_layer(conv, TENSORS, i, where)
    finally:
        conv.skip_ffn = conv_skip
    ffn_target = ffn_where or where
    if not conv_skip:  # else the experts and their predictors come from the MoE prepared file
        values = conv.values  # the checkpoint's values even where the layer's dense part is mapped
        predictors = load_predictors(values, i, ffn_target) if ffn_where is not None else None
        layer.ffn = DenseMoe(*load_experts(values, i, ffn_target), activation=cfg.activation, predictors=predictors)
    layer.router = conv.get(ROUTER.format(i=i), (cfg.num_experts, cfg.hidden_size), where)
    return layer
