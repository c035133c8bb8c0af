"""Find models on the Hugging Face Hub that Thermocline runs.

A search over `huggingface_hub.list_models` (the Hub at HF_ENDPOINT), keeping only the
architectures the engine's own modules claim (`engine.arch`), then each candidate's
config.json read and parsed the way a download would be: a SwiGLU Llama, whose neurons never
stay silent, is left out like any other model the engine refuses. Each result carries its
download size, the fit verdict and speed on this machine (the same estimate the catalogue
uses), and how it will run: sparse with its predictors, or dense until predictors are made.
"""

from __future__ import annotations

import json
import logging
import re

from engine.activations import is_sparse
from engine.arch import module_for
from engine.budget_policy import usable_ram
from engine.errors import ModelFormatError, UserError

from .arch import detect_architecture
from .fit import BytesModel, estimate_fit
from .hardware import probe_hardware
from .hub import OfflineModeOn, hub_endpoint, hub_error, is_offline
from .speed import measured_reason, read_bandwidth, speed_words, words_per_second

log = logging.getLogger(__name__)

CANDIDATES = 40      # models asked of the Hub per search (most downloaded first)
SHOWN = 12           # results kept
CONFIG_LIMIT = 1024**2  # a config.json larger than this is not a config
DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
               "I8": 1, "U8": 1, "BOOL": 1}
# Files by which a repo carries activation predictors: PowerInfer's per-layer checkpoints, ours.
PREDICTOR_FILES = re.compile(r"(^|/)model_\d+\.pt$|^thermocline/predictors\.safetensors$|\.powerinfer\.gguf$")
NO_PREDICTORS = ("has no predictors: it runs dense (every neuron computed) until they are made for it "
                 "(thermocline profile, then thermocline train-predictors)")
WITH_PREDICTORS = "carries its predictors: it runs sparse"
SWIGLU_DENSE = ("runs dense: its SwiGLU neurons never output zero, so every one is computed "
                "(thermocline profile --target-sparsity 0.5 opts into CATS sparsity)")


def runs_words(siblings: list[str], catalogued: bool = False) -> tuple[bool, str]:
    """(has predictors, how it will run) for a repo's file names."""
    if catalogued:
        return True, "in the catalogue: its predictors come with the download"
    has = any(PREDICTOR_FILES.search(name) for name in siblings)
    return has, WITH_PREDICTORS if has else NO_PREDICTORS


def _size_from_safetensors(info) -> int | None:
    params = getattr(getattr(info, "safetensors", None), "parameters", None) or {}
    total = sum(int(n) * DTYPE_BYTES.get(str(dtype).upper(), 2) for dtype, n in params.items())
    return total or None


def _claims_architecture(config: dict | None) -> bool:
    """The listing's config subset (architectures, model_type) names a family the engine has."""
    if not config:
        return False
    try:
        module_for({k: config[k] for k in ("architectures", "model_type") if k in config})
    except ModelFormatError:
        return False
    return True


def _read_config(repo: str, endpoint: str, token: str | None, timeout: float) -> dict:
    """The repo's config.json at main, read into memory (nothing is written to disk)."""
    from huggingface_hub import get_session

    from .hub import auth_headers, file_url

    url = file_url(endpoint, repo, "main", "config.json")
    body = bytearray()
    with get_session().stream("GET", url, headers=auth_headers(token), follow_redirects=True,
                              timeout=timeout) as r:
        r.raise_for_status()
        for chunk in r.iter_bytes():  # read no further than the limit: a hostile repo may serve gigabytes
            body += chunk
            if len(body) > CONFIG_LIMIT:
                raise ModelFormatError(f"{repo}: config.json is over {CONFIG_LIMIT:,} bytes, too large to be a config")
    return json.loads(bytes(body))


def search_hub(query: str, *, ctx: int = 2048, cpu_weights: str = "int8", token: str | None = None,
               catalogue_repos: dict[str, str] | None = None, limit: int = SHOWN, timeout: float = 20.0,
               hardware=None) -> list[dict]:
    """Models matching `query` that Thermocline runs, as rows: repo, size, verdict, reason,
    speed words, how it runs. `catalogue_repos` maps repo ids to catalogue ids (those are
    marked, and run as the catalogue says). Raises a UserError saying what went wrong."""
    import httpx2
    from huggingface_hub import HfApi, errors

    query = " ".join(str(query or "").split())
    if not query:
        raise UserError("type part of a model's name to search the Hub")
    if is_offline():
        raise OfflineModeOn("offline mode is on: the Hub cannot be searched")
    endpoint = hub_endpoint()
    api = HfApi(endpoint=endpoint, token=token or False, library_name="thermocline")
    try:
        found = list(api.list_models(search=query, limit=CANDIDATES, sort="downloads",
                                     expand=["config", "safetensors", "siblings", "downloads"]))
    except (errors.HfHubHTTPError, httpx2.HTTPError, OSError) as exc:
        raise hub_error(exc, f"the search “{query}”", endpoint, token) from exc
    hw = hardware or probe_hardware()
    bandwidth = read_bandwidth()
    catalogue_repos = {k.lower(): v for k, v in (catalogue_repos or {}).items()}
    rows = []
    for info in found:
        if len(rows) >= limit:
            break
        if not _claims_architecture(getattr(info, "config", None)):
            continue
        try:
            config = _read_config(info.id, endpoint, token, timeout)
            arch = detect_architecture(config)  # the engine's refusal (a missing key, GELU...) leaves it out
        except (httpx2.HTTPError, OSError, ValueError, UserError) as exc:
            log.info("hub search: %s left out (%s)", info.id, exc)
            continue
        siblings = [s.rfilename for s in (getattr(info, "siblings", None) or [])]
        catalogued = catalogue_repos.get(info.id.lower())
        has_predictors, runs = runs_words(siblings, bool(catalogued))
        if not is_sparse(arch.activation):
            has_predictors, runs = False, SWIGLU_DENSE
        try:
            # Against what this machine can give (its usable free VRAM and RAM), not a suggestion.
            est = estimate_fit(config, ctx=ctx, vram_budget=hw.usable_vram_free, ram_budget=usable_ram(hw.ram_available),
                               bytes_model=BytesModel(cpu_weights=cpu_weights),
                               sparsity=None if has_predictors else 0.0)
        except Exception as exc:  # noqa: BLE001 - a model we cannot size is still shown, said so
            verdict, reason, words_s, params = "unknown", str(exc), None, 0
        else:
            verdict, reason, words_s, params = est.verdict, measured_reason(est), words_per_second(est, bandwidth), \
                est.total_params
        size = _size_from_safetensors(info) or (params * 2 if params else None)  # 16-bit weights when unsaid
        rows.append({"repo": info.id, "catalogue_id": catalogued, "size": size, "verdict": verdict,
                     "reason": reason, "words_s": words_s,
                     "speed": speed_words(words_s) if words_s is not None else "", "predictors": has_predictors,
                     "runs": runs, "downloads": getattr(info, "downloads", None)})
    return rows
