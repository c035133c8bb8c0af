"""The ReLU-family decoders on vLLM's parallel layers.

One Llama-shaped decoder (RMSNorm, rotary attention with grouped KV heads, gated FFN) whose FFN
is the family's:

- ReluLLaMA:               down(relu(gate(x)) * up(x))
- ProSparse (fatrelu, t):   down(fatrelu_t(gate(x)) * up(x)),  fatrelu_t(v) = v if v > t else 0
- Bamboo / TurboSparse:     down(relu(gate(x)) * relu(up(x))), times TurboSparse's predictor mask
                            [fc2(relu(fc1(h))) > 0] where h is the residual stream before the
                            FFN's norm (the published code rounds a sigmoid of the same logits)
- TurboSparse-Mixtral:      a mixture of such dReLU experts (w1 gate, w3 up, w2 down), each with
                            its own predictor reading the expert's input x; the router softmaxes
                            all experts' logits and renormalises the top k (Mixtral's routing)

Tensor parallelism: q/k/v and gate/up are column-parallel (each rank holds whole heads and a
slice of the FFN neurons), o_proj and down_proj row-parallel (one all-reduce each), the
embeddings and head vocabulary-parallel. A mixture's router is whole on every rank (each rank
routes every token alike) and each expert is cut as a dense FFN is, its down projection left
unreduced: the weighted sum of the chosen experts takes one all-reduce. The predictor's fc1 is
whole on every rank and its fc2 cut by rows as gate_up_proj is cut, so each rank predicts
exactly its own neurons. Pipeline parallelism splits the layers (make_layers). Checkpoint tensors keep the families' published names
(`model.layers.N.mlp.gate_proj.weight`, `...mlp.predictor.fc1.weight`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.activation import FatreluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors

# checkpoint name -> (parameter name, shard): the fused projections vLLM shards as one matrix
STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
    # a Mixtral expert's gate, up and down (block_sparse_moe.experts.E.w1/w3/w2)
    (".w1.", ".gate_up_proj.", 0),
    (".w3.", ".gate_up_proj.", 1),
    (".w2.", ".down_proj.", None),
)


class GatedFFN(nn.Module):
    """gate/up fused into one column-parallel matrix, down row-parallel; `kind` is the
    family's activation: "relu" and "fatrelu" act on the gate only, "drelu" on both halves."""

    def __init__(self, config, kind: str, quant_config, prefix: str, reduce_results: bool = True):
        super().__init__()
        d, n = config.hidden_size, config.intermediate_size
        self.kind = kind
        self.gate_up_proj = MergedColumnParallelLinear(d, [n] * 2, bias=False, quant_config=quant_config,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(n, d, bias=False, quant_config=quant_config, reduce_results=reduce_results,
                                           prefix=f"{prefix}.down_proj")
        if kind == "fatrelu":
            self.fatrelu = FatreluAndMul(threshold=float(config.hidden_act_param))
        self.predictor: Predictor | None = None  # set while loading a checkpoint that has one

    def forward(self, x: torch.Tensor, before_norm: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        if self.kind == "fatrelu":
            h = self.fatrelu(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = torch.relu(gate) * (torch.relu(up) if self.kind == "drelu" else up)
        if self.predictor is not None:
            h = h * self.predictor(before_norm)
        out, _ = self.down_proj(h)
        return out


class DreluMoe(nn.Module):
    """TurboSparse-Mixtral's block_sparse_moe: a router whole on every rank, then each
    expert (a dReLU GatedFFN with its predictor, cut over the ranks) on the tokens routed to
    it, weighted; one all-reduce for the sum of all of them."""

    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=False, quant_config=None,
                                     prefix=f"{prefix}.gate")
        self.experts = nn.ModuleList(
            GatedFFN(config, "drelu", quant_config, f"{prefix}.experts.{e}", reduce_results=False)
            for e in range(config.num_local_experts))

    def forward(self, x: torch.Tensor, before_norm: torch.Tensor) -> torch.Tensor:
        logits, _ = self.gate(x)
        # softmax over all experts, the top k renormalised: a softmax over the top k's logits
        top, chosen = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        weights = (top / top.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tokens, slot = torch.where(chosen == e)
            if tokens.numel():  # every rank routes alike, and an expert has no collective of its own
                picked = x[tokens]
                # the expert's predictor reads the expert's own input
                out.index_add_(0, tokens, expert(picked, picked) * weights[tokens, slot, None])
        return tensor_model_parallel_all_reduce(out) if get_tensor_model_parallel_world_size() > 1 else out


class Predictor(nn.Module):
    """TurboSparse's neuron predictor, cut to this rank's neurons: fc1 [r, d] whole, fc2's rows
    [n/tp, r] for the neurons gate_up_proj gives this rank (vLLM's column split: rank i holds
    neurons i*n/tp .. (i+1)*n/tp of each half). The published configs do not record r, so the
    predictor takes its shape from the checkpoint's tensors as they load."""

    def __init__(self, like: torch.Tensor):
        super().__init__()
        self.dtype, self.device = like.dtype, like.device
        self.fc1: torch.Tensor | None = None
        self.fc2: torch.Tensor | None = None

    def load(self, which: str, tensor: torch.Tensor, neurons_here: int) -> None:
        if which == "fc2":
            rank = get_tensor_model_parallel_rank()
            tensor = tensor.narrow(0, rank * neurons_here, neurons_here)
        setattr(self, which, tensor.to(device=self.device, dtype=self.dtype).contiguous())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = torch.relu(h @ self.fc1.T) @ self.fc2.T
        return (logits > 0).to(h.dtype)


class SelfAttention(nn.Module):
    def __init__(self, config, cache_config, quant_config, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % tp:
            raise ValueError(f"{heads} attention heads do not split over tensor_parallel_size {tp}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        # fewer KV heads than ranks: each rank keeps a copy of one (vLLM's QKVParallelLinear does so)
        self.q_size = heads // tp * head_dim
        self.kv_size = max(1, kv_heads // tp) * head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, heads, kv_heads, bias=False,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias=False,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(head_dim, max_position=config.max_position_embeddings,
                                   rope_parameters=getattr(config, "rope_parameters", None), is_neox_style=True)
        # a Mistral-style sliding window reaches Attention through vLLM's cache config
        self.attn = Attention(heads // tp, head_dim, head_dim**-0.5, num_kv_heads=max(1, kv_heads // tp),
                              cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str, kind: str):
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant = vllm_config.quant_config
        self.self_attn = SelfAttention(config, vllm_config.cache_config, quant, f"{prefix}.self_attn")
        # the FFN under the family's published name: `mlp`, or Mixtral's `block_sparse_moe`
        if kind == "drelu-moe":
            self.ffn_name = "block_sparse_moe"
            self.block_sparse_moe = DreluMoe(config, quant, f"{prefix}.block_sparse_moe")
        else:
            self.ffn_name = "mlp"
            self.mlp = GatedFFN(config, kind, quant, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, x, residual):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        # the fused add-norm hands back the residual stream before the norm: the predictor's input
        x, residual = self.post_attention_layernorm(x, residual)
        return getattr(self, self.ffn_name)(x, residual), residual


class ReluFamilyModel(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str, kind: str):
        super().__init__()
        config = vllm_config.model_config.hf_config
        pp = get_pp_group()
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if pp.is_first_rank or (config.tie_word_embeddings and pp.is_last_rank)
                             else PPMissingLayer())
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: DecoderLayer(vllm_config, prefix, kind),
            prefix=f"{prefix}.layers",
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if pp.is_last_rank else PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size)

    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
        if get_pp_group().is_first_rank:
            x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
            residual = None
        else:
            x, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in self.layers[self.start_layer:self.end_layer]:
            x, residual = layer(positions, x, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": x, "residual": residual})
        x, _ = self.norm(x, residual)
        return x


class _ReluFamilyForCausalLM(nn.Module, SupportsPP):
    """What the registered classes share; each names its FFN (`_ffn_kind`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = ReluFamilyModel(vllm_config, maybe_prefix(prefix, "model"), self._ffn_kind(config))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
            self.logits_processor = LogitsProcessor(config.vocab_size)
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    @staticmethod
    def _ffn_kind(config) -> str:
        raise NotImplementedError

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb." in name:
                continue
            if self.config.tie_word_embeddings and name.startswith("lm_head."):
                continue  # the head is the embedding matrix
            if ".predictor." in name:
                if not is_pp_missing_parameter(name, self):
                    self._load_predictor(name, tensor)
                loaded.add(name)
                continue
            shard = None
            for published, fused, shard_id in STACKED:
                if published in name:
                    name, shard = name.replace(published, fused), shard_id
                    break
            if is_pp_missing_parameter(name, self):
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[name]
            if shard is None:  # a renamed w2 too
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
            loaded.add(name)
        return loaded

    def _load_predictor(self, name: str, tensor: torch.Tensor) -> None:
        raise ValueError(f"checkpoint tensor {name!r}: {type(self).__name__} has no neuron predictor")


def _llama_ffn(config) -> str:
    act = getattr(config, "hidden_act", None)
    if act not in ("relu", "fatrelu"):
        raise ValueError(f"hidden_act {act!r}: this plugin runs the ReLU-family Llamas (relu, fatrelu); "
                         "vLLM's own LlamaForCausalLM runs silu")
    return act


class ReluLlamaForCausalLM(_ReluFamilyForCausalLM):
    """ReluLLaMA (`LlamaForCausalLM`, `hidden_act: relu`), named through
    `--hf-overrides '{"architectures": ["ReluLlamaForCausalLM"]}'`."""

    _ffn_kind = staticmethod(_llama_ffn)


class SparseLlamaForCausalLM(_ReluFamilyForCausalLM):
    """ProSparse-Llama-2 (`hidden_act: fatrelu`, threshold `hidden_act_param`)."""

    _ffn_kind = staticmethod(_llama_ffn)


def load_predictor_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """`...mlp.predictor.fc1.weight` or `...experts.E.predictor.fc2.weight` into that FFN's
    Predictor, made at its first tensor (the rank is the checkpoint's)."""
    ffn_path, which = name.rsplit(".predictor.", 1)
    ffn = model.get_submodule(ffn_path)
    if ffn.predictor is None:
        ffn.predictor = Predictor(ffn.gate_up_proj.weight)
    ffn.predictor.load(which.split(".")[0], tensor, ffn.gate_up_proj.output_size_per_partition // 2)


class BambooForCausalLM(_ReluFamilyForCausalLM):
    """Bamboo and TurboSparse-Mistral: dReLU; TurboSparse's checkpoint adds a predictor per
    layer (`mlp.predictor.fc1/fc2`), which masks the FFN as the published code does."""

    @staticmethod
    def _ffn_kind(config) -> str:
        return "drelu"

    _load_predictor = load_predictor_tensor


class TurboSparseMixtralForCausalLM(_ReluFamilyForCausalLM):
    """TurboSparse-Mixtral (`model_type: turbosparsemixtral`): Mixtral's attention and routing,
    dReLU experts, a predictor per expert (`block_sparse_moe.experts.E.predictor.fc1/fc2`)."""

    @staticmethod
    def _ffn_kind(config) -> str:
        if getattr(config, "hidden_act", "relu") != "relu":
            raise ValueError(f"hidden_act {config.hidden_act!r}: TurboSparse-Mixtral's experts are dReLU (relu)")
        return "drelu-moe"

    _load_predictor = load_predictor_tensor
