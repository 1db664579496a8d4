"""The bare install (issue 23): the wheel, installed without extras into a fresh venv, imports pace_hf and
runs the README's first example, and brings none of the extras' packages.

How the venv gets its requirements without downloading a gigabyte: the wheel's own ``Requires-Dist``
(read from the built wheel, no extras) and their requirements, as installed here, are linked into one
folder that a ``.pth`` file puts on the venv's path. pip sees them as installed and fetches from the index
only what this environment lacks. Nothing else of this environment is visible there: a core module that
imports an extra's package, or an extra that slips into the core requirements, fails the test.
"""

import json
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
EXTRAS_ONLY = ("triton", "datasets", "evaluate", "matplotlib", "gguf", "accelerate", "valkey")  # never in a bare install
MODEL_ID = '"Qwen/Qwen2.5-Coder-0.5B-Instruct"'  # the README example's model, swapped for a tiny local one


def readme_first_example() -> str:
    """The first Python block of the README's Usage section."""
    usage = REPO.joinpath("README.md").read_text().split("\n## Usage\n", 1)[1]
    return re.search(r"```python\n(.*?)```", usage, re.S).group(1)


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The core requirements of ``wheel`` (its ``Requires-Dist`` that no extra asks for)."""
    with zipfile.ZipFile(wheel) as z:
        metadata = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
    return [r for r in map(Requirement, metadata.get_all("Requires-Dist") or [])
            if r.marker is None or r.marker.evaluate({"extra": ""})]


def _closure(requirements: list[Requirement]) -> list:
    """The distributions installed here that ``requirements`` need, and all they need in turn (no
    extras). A requirement not installed here is left for pip to fetch."""
    found, todo = {}, [r.name for r in requirements]
    while todo:
        key = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if key in found:
            continue
        try:
            found[key] = dist = distribution(key)
        except PackageNotFoundError:
            continue
        todo += [r.name for r in map(Requirement, dist.requires or [])
                 if r.marker is None or r.marker.evaluate({"extra": ""})]
    return list(found.values())


def _link(dists: list, folder: Path) -> None:
    """Link ``dists`` (their top-level files, as their RECORDs list them) into ``folder``."""
    folder.mkdir()
    for dist in dists:
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")} - {"__pycache__"}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (folder / top).exists():
                (folder / top).symlink_to(source)


def _tiny_model(path: Path, text: str) -> None:
    """A random 2-layer Llama and a word-level tokenizer for ``text``, saved as a local model."""
    import tokenizers
    import torch
    import transformers as tf

    vocab = {w: i for i, w in enumerate(["[UNK]", "<eos>", *dict.fromkeys(text.split())])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>").save_pretrained(path)
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                            eos_token_id=1, pad_token_id=1)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def _run(*cmd, cwd=None, timeout=600) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def test_the_readme_example_is_what_the_install_test_runs():
    example = readme_first_example()
    assert example.count(MODEL_ID) == 1 and "from pace_hf import" in example and "pace_bench" not in example


@pytest.mark.slow  # a wheel, a venv and a subprocess that imports torch: about half a minute
def test_a_bare_install_runs_the_readme_example_without_the_extras(tmp_path):
    # The wheel, built from a copy of the sources so the checkout gets no build/ or egg-info.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("pace_hf", "pace_bench"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist",
         source)
    (wheel,) = (tmp_path / "dist").glob("pace_hf-*.whl")

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    requirements = wheel_requirements(wheel)
    assert {"torch", "transformers"} <= {r.name for r in requirements} and not {r.name for r in requirements} & set(EXTRAS_ONLY)
    _link(_closure(requirements), tmp_path / "requirements")
    (site / "requirements.pth").write_text(str(tmp_path / "requirements") + "\n")
    _run(python, "-m", "pip", "install", "-q", wheel)

    text = " ".join(f"word{i % 97} line{i % 13}." for i in range(1500))  # 3,000 tokens: past the budget of 2,048
    (tmp_path / "session.txt").write_text(text)
    _tiny_model(tmp_path / "model", text)
    example = readme_first_example().replace(MODEL_ID, repr(str(tmp_path / "model")))
    check = f"""
import importlib.metadata, importlib.util, json
import pace_hf
{example}
try:
    pace_hf.ValkeyTier()
    valkey_error = None
except ImportError as e:
    valkey_error = str(e)
try:
    from pace_hf.kernels import rerotate_triton
    cuda_error = None
except ImportError as e:
    cuda_error = str(e)
print(json.dumps({{
    "version": pace_hf.__version__, "installed": importlib.metadata.version("pace_hf"),
    "typed": (importlib.util.find_spec("pace_hf").submodule_search_locations[0] + "/py.typed"),
    "extras_found": [m for m in {EXTRAS_ONLY!r} if importlib.util.find_spec(m) is not None],
    "resident": len(logical), "seen": ids.shape[1], "new_tokens": out.shape[1] - ids.shape[1],
    "max_physical": int(physical.max()), "valkey_error": valkey_error, "cuda_error": cuda_error,
}}))
"""
    got = json.loads(_run(python, "-c", check, cwd=tmp_path).strip().splitlines()[-1])
    assert got["extras_found"] == []
    assert got["version"] == got["installed"] == distribution("pace_hf").version
    assert Path(got["typed"]).is_file()
    assert got["seen"] > 2048 and got["new_tokens"] > 0
    assert got["resident"] <= 2048 and got["max_physical"] < 8192  # evicted to the budget, positions bounded
    assert "pip install pace_hf[valkey]" in got["valkey_error"]  # an extra's part, used without it, says so
    assert "pip install pace_hf[cuda]" in got["cuda_error"]
    installed = _run(python, "-m", "pip", "list", "--format", "json")
    names = {re.sub(r"[-_.]+", "-", p["name"]).lower() for p in json.loads(installed)}
    assert not names & set(EXTRAS_ONLY)
