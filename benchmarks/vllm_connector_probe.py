"""Probe vLLM 0.32's CPU paged KV cache through a KV connector, before we write a real one.

A CacheBlend connector must write blended K/V straight into vLLM's KV blocks, so the exact
layout matters.  This probe checks it end to end on the default model, in three runs:

1. ``dump``: a normal prefill; after the forward (``wait_for_save``) the connector reads the
   request's blocks back and saves K/V.  They are compared with HF transformers' cache
   (post-RoPE keys) under three readings of the ``[blocks, heads, block_size, 2*head]``
   page: "kt" (what the CPU kernel does: per block and head, K transposed as
   ``[head, block_size]``, then V as ``[block_size, head]``), "split" (K and V both
   ``[block_size, head]``) and "inter" (K|V concatenated per token).
2. ``load``: the scheduler side reports ``len(prompt) - 1`` tokens as external hits; the
   worker side writes HF's K/V for them into the blocks; vLLM computes only the last
   token.  Its top-20 logprobs must match the full prefill of run 1.
3. ``control``: same as ``load`` but nothing is written, to show the K/V really is used.

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python benchmarks/vllm_connector_probe.py --tokens 300 --data ../shared/data

The prompt is text of ``musique_s.json`` in the data directory (``--data DIR``, else
``$CACHEBLEND_DATA``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)


def prompt_key(ids: list[int]) -> str:
    return hashlib.sha1(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()[:16]


def layer_index(name: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", name).group(1))


def paged_views(cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer's CPU cache ``[blocks, kv_heads, block_size, 2*head]``: K as
    ``[blocks, kv_heads, head, block_size]`` (transposed) and V as ``[blocks, kv_heads,
    block_size, head]``.  Each (block, head) page holds ``block_size*head`` K values and
    then as many V values; this is the layout the "vec" attention ISA reads."""
    nb, heads = cache.shape[:2]
    halves = cache.view(nb, heads, 2, -1)
    head = halves.shape[-1] // block_size
    return halves[:, :, 0].unflatten(-1, (head, block_size)), halves[:, :, 1].unflatten(-1, (block_size, head))


@dataclass
class ReqInfo:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_load: int


@dataclass
class ProbeMeta(KVConnectorMetadata):
    reqs: list[ReqInfo] = field(default_factory=list)


class ProbeConnector(KVConnectorBase_V1):
    """Dumps (mode ``dump``) or injects (``load``/``control``) whole-prompt K/V."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.mode: str = extra["mode"]
        self.dir = Path(extra["dir"])
        self.block_size: int = vllm_config.cache_config.block_size
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.pending: dict[str, int] = {}
        self._note(f"role_{role.name}", {"pid": os.getpid(), "block_size": self.block_size})

    def _note(self, key: str, value: Any) -> None:
        """Facts for the driver, one small JSON file each (the sides live in other processes)."""
        (self.dir / f"note_{self.mode}_{key}.json").write_text(json.dumps(value))

    # ---- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        ids = list(request.prompt_token_ids or [])
        if self.mode == "dump" or not (self.dir / f"hf_{prompt_key(ids)}.pt").exists():
            return 0, False
        return len(ids) - 1 - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self.pending[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = ProbeMeta()
        for req in scheduler_output.scheduled_new_reqs:
            meta.reqs.append(ReqInfo(req.req_id, list(req.prompt_token_ids or []),
                                     list(req.block_ids[0]), self.pending.pop(req.req_id, 0)))
        return meta

    # ---- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = dict(sorted(kv_caches.items(), key=lambda kv: layer_index(kv[0])))
        name, t = next(iter(self.kv_caches.items()))
        self._note("kv_caches", {"pid": os.getpid(), "num_layers": len(kv_caches), "first": name,
                                 "shape": list(t.shape), "stride": list(t.stride()),
                                 "dtype": str(t.dtype), "is_contiguous": t.is_contiguous(),
                                 "same_storage": len({c.untyped_storage().data_ptr()
                                                      for c in kv_caches.values()}) == 1})

    def _slots(self, block_ids: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(n)
        return torch.tensor(block_ids)[t // self.block_size], t % self.block_size

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for req in meta.reqs:
            if req.num_load == 0:
                continue
            self._note("load_" + req.req_id.replace("/", "_"),
                       {"pid": os.getpid(), "num_load": req.num_load, "blocks": req.block_ids})
            if self.mode != "load":
                continue
            hf = torch.load(self.dir / f"hf_{prompt_key(req.token_ids)}.pt")
            blk, off = self._slots(req.block_ids, req.num_load)
            for i, cache in enumerate(self.kv_caches.values()):
                k_t, v = paged_views(cache, self.block_size)
                k_t[blk, :, :, off] = hf["k"][i, :, : req.num_load].permute(1, 0, 2).to(cache.dtype)
                v[blk, :, off] = hf["v"][i, :, : req.num_load].permute(1, 0, 2).to(cache.dtype)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        """After the forward: read each dumped request's K/V back under the three readings."""
        if self.mode != "dump":
            return
        for req in self._get_connector_metadata().reqs:
            n = len(req.token_ids)
            blk, off = self._slots(req.block_ids, n)
            bs = self.block_size
            out: dict[str, list[torch.Tensor]] = {f"{kv}_{r}": [] for kv in "kv" for r in ("kt", "split", "inter")}
            for cache in self.kv_caches.values():
                k_t, v_pg = paged_views(cache, bs)
                out["k_kt"].append(k_t[blk, :, :, off].permute(1, 0, 2).clone())
                out["v_kt"].append(v_pg[blk, :, off].permute(1, 0, 2).clone())
                paged = cache.view(cache.shape[0], cache.shape[1], 2 * bs, -1)
                out["k_split"].append(paged[blk, :, off].permute(1, 0, 2).clone())
                out["v_split"].append(paged[blk, :, bs + off].permute(1, 0, 2).clone())
                row = cache[blk, :, off]  # [n, H, 2*head]
                half = row.shape[-1] // 2
                out["k_inter"].append(row[..., :half].permute(1, 0, 2).clone())
                out["v_inter"].append(row[..., half:].permute(1, 0, 2).clone())
            torch.save({name: torch.stack(parts) for name, parts in out.items()},
                       self.dir / f"vllm_{prompt_key(req.token_ids)}.pt")


# ---------------------------------------------------------------- driver (main process)

def hf_kv(model_dir: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF transformers' post-RoPE K/V ``[L, H, T, D]`` and last-position log-probs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    k = torch.stack([layer.keys[0] for layer in cache.layers])
    v = torch.stack([layer.values[0] for layer in cache.layers])
    return k, v, torch.log_softmax(out.logits[0, -1].float(), -1)


def run_llm(mode: str, args: argparse.Namespace, ids: list[int]) -> dict:
    """One LLM with the probe connector; returns the first token's top-20 logprobs."""
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=2048, max_num_seqs=1, seed=0,
              kv_transfer_config={"kv_connector": "ProbeConnector",
                                  "kv_connector_module_path": "vllm_connector_probe",
                                  "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"mode": mode, "dir": args.dir}})
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    comp = out.outputs[0]
    return {"token": comp.token_ids[0], "cached": out.num_cached_tokens,
            "top": {int(t): float(lp.logprob) for t, lp in comp.logprobs[0].items()}}


def compare_top(a: dict, b: dict) -> float:
    common = set(a["top"]) & set(b["top"])
    return max(abs(a["top"][t] - b["top"][t]) for t in common) if common else float("inf")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--dir", default="bench-out/connector_probe")
    ap.add_argument("--data", default=None, metavar="DIR", help="the data directory; default: $CACHEBLEND_DATA")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = here + os.pathsep + os.environ.get("PYTHONPATH", "")
    from cacheblend.datasets import data_file
    from cacheblend.models.loader import resolve_model_dir

    try:
        data = data_file("musique_s.json", args.data)
    except FileNotFoundError as e:
        raise SystemExit(f"vllm_connector_probe: {e}") from None
    args.model = str(resolve_model_dir(args.model))
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    for f in Path(args.dir).glob("*"):
        f.unlink()
    text = data.read_text()[:20000]
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(args.model)(text)["input_ids"][: args.tokens]
    report: dict[str, Any] = {"prompt_tokens": len(ids)}

    full = run_llm("dump", args, ids)
    k, v, hf_logp = hf_kv(args.model, ids)
    got = torch.load(Path(args.dir) / f"vllm_{prompt_key(ids)}.pt")
    for reading in ("kt", "split", "inter"):
        report[f"max_abs_err_k_{reading}"] = float((got[f"k_{reading}"] - k).abs().max())
        report[f"max_abs_err_v_{reading}"] = float((got[f"v_{reading}"] - v).abs().max())
    report["kv_shape_hf"] = list(k.shape)
    report["full_vs_hf_top20_max_abs"] = max(abs(full["top"][t] - float(hf_logp[t])) for t in full["top"])
    torch.save({"k": k, "v": v}, Path(args.dir) / f"hf_{prompt_key(ids)}.pt")

    loaded = run_llm("load", args, ids)
    control = run_llm("control", args, ids)
    report.update(full=full["token"], loaded=loaded["token"], control=control["token"],
                  loaded_vs_full_top20_max_abs=compare_top(loaded, full),
                  control_vs_full_top20_max_abs=compare_top(control, full),
                  cached_tokens_reported={"full": full["cached"], "load": loaded["cached"]})
    report["notes"] = {p.stem: json.loads(p.read_text()) for p in sorted(Path(args.dir).glob("note_*.json"))}
    (Path(args.dir) / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1), file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
