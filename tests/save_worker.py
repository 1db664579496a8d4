"""A subprocess for tests/test_save_atomic.py: real SIGKILLs inside ``PACESession.save()``, and racing writers.

    python save_worker.py ROOT OUT.json

One process imports torch once and forks a child per case (the store's threads exist only in the children):
- ``base``: turn 1, save (generation 1) to a disk store; that store is closed before any fork.
- ``reference``: a child resumes a copy of base, plays turn 2 and saves (generation 2) without a kill,
  counting the I/O calls of its save (open, write, fsync, replace, unlink, mkdir) and timing it.
- ``kill k``: the same in another copy, SIGKILLed just before the k-th I/O call of the save, for every k
  (two children at a time);
  ``random``: SIGKILLed by the parent at a random time inside the save.
- ``race r``: two children resume one copy, play different turns and save at once.
After each, the parent resumes what is on disk and reports whether it is exactly generation 1 or 2 (by
every layer tensor, the conversation, and the next-token logits of a probe token), or what else it got.
"""

import json
import os
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from session_worker import session_model  # noqa: E402

from pace_hf.session import PACESession  # noqa: E402
from pace_hf.tiers import DiskTier, TieredStore  # noqa: E402

SID = "atomic"
TURN1 = "Define VAULT_CODE = 4471 and a class Ledger with owner and balance. " * 2
TURN2 = "Now some unrelated notes about trains, weather and lunch. " * 3
RACE_TURNS = ("Writer A says: the river is wide. " * 3, "Writer B says: the mountain is tall. " * 3)
HOOKED = ("open", "write", "fsync", "replace", "unlink", "mkdir")
RACE_DELAYS = (0.0, 0.001, 0.01, 0.3)  # writer B starts its save this much later: from at once to after A's


def layer_tensors(cache) -> dict:
    return {f"{i}/{k}": v.clone() for i, layer in enumerate(cache.layers) if layer.is_initialized
            for k, v in layer.tensors().items()}


def probe_logits(model, cache) -> torch.Tensor:
    """The next-token logits after one fixed token: what the resumed KV makes the model say."""
    with torch.no_grad():
        return model(torch.tensor([[42]]), cache=cache, use_cache=True).logits[0, -1].clone()


def play(session, text: str, tokens: int = 8) -> None:
    session.add("user", text)
    session.generate(max_new_tokens=tokens, min_new_tokens=tokens)


class IOCounter:
    """Wraps the ``os`` calls a save's writes and deletes go through; SIGKILLs this process just before
    the ``kill_at``-th one (None: count only)."""

    def __init__(self, kill_at=None):
        self.kill_at, self.count, self.lock = kill_at, 0, threading.Lock()
        for name in HOOKED:
            setattr(os, name, self._wrap(getattr(os, name)))

    def _wrap(self, fn):
        def call(*args, **kwargs):
            with self.lock:
                self.count += 1
                if self.count == self.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return call


def child(fn) -> int:
    """Run ``fn`` in a forked child; return its pid (the child never returns)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported through the exit code and stderr
            print(f"child error: {type(e).__name__}: {e}", file=sys.stderr)
            code = 3
        os._exit(code)
    return pid


def wait(pid) -> int:
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def continue_and_save(model, tokenizer, root, text, before_save=None, after_save=None, queue_size=64):
    """``queue_size=1``: the writer takes one put at a time, so every run makes the same I/O calls in the
    same order (a batch of 2 or more is one group commit, and how many puts a batch takes is up to the
    threads' timing); the random kills and the races keep the default, group commits included."""
    store = TieredStore([DiskTier(root)], queue_size=queue_size)
    session = PACESession.resume(SID, model, tokenizer, store=store)
    play(session, text, tokens=2)
    store.flush()  # the turn's spill writes are done: the save's own I/O calls are counted from here
    if before_save:
        before_save(session)
    gen = session.save()
    store.flush()  # and what it retired, deleted on the writer thread once it returned (a child ends with _exit)
    if after_save:
        after_save(session, gen)


def read_back(model, tokenizer, root) -> dict:
    """Resume ``root`` in a fresh store: the tensors, conversation and probe logits, or the refusal."""
    store = TieredStore([DiskTier(root)])
    try:
        session = PACESession.resume(SID, model, tokenizer, store=store)
    except Exception as e:  # noqa: BLE001 - a refusal is an outcome the test checks
        store.close()
        return {"refused": f"{type(e).__name__}: {e}"}
    out = {"tensors": layer_tensors(session.cache), "ids": list(session.ids), "logits": probe_logits(model, session.cache),
           "generation": session.cache.spill.generation}
    session.cache.unbind()
    store.close()
    return out


def same(a: dict, b: dict) -> bool:
    return ("refused" not in a and "refused" not in b and a["ids"] == b["ids"] and a["tensors"].keys() == b["tensors"].keys()
            and all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"])
            and torch.equal(a["logits"], b["logits"]))


def classify(got: dict, old: dict, new: dict) -> str:
    if "refused" in got:
        return "refused: " + got["refused"]
    return "old" if same(got, old) else "new" if same(got, new) else "mix"


def state_files(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if "%40g" in p.name}


def main(root, out):
    root = Path(root)
    torch.set_num_threads(1)  # no OpenMP pool in a process that forks
    model, tokenizer = session_model()
    report = {"kills": [], "random": [], "races": [], "seconds": {}}
    started = time.perf_counter()

    base = root / "base"
    store = TieredStore([DiskTier(base)])
    session = PACESession(model, tokenizer, budget=48, limit=160, recent=8, store=store, session_id=SID, chunk=32,
                          spill_tokens=8)
    play(session, TURN1)
    session.save()
    live1 = layer_tensors(session.cache)
    session.cache.unbind()
    store.close()

    ref = root / "ref"
    shutil.copytree(base, ref)
    stats = root / "ref.json"

    def reference():
        counter = {}

        def start(session):
            counter["io"], counter["t"] = IOCounter(), time.perf_counter()

        def done(session, gen):
            stats.write_text(json.dumps({"io": counter["io"].count, "seconds": time.perf_counter() - counter["t"],
                                         "generation": gen}))
            torch.save(layer_tensors(session.cache), root / "live2.pt")
        continue_and_save(model, tokenizer, ref, TURN2, start, done, queue_size=1)

    assert wait(child(reference)) == 0, "the reference save failed"
    ref_stats = json.loads(stats.read_text())
    old, new = read_back(model, tokenizer, base), read_back(model, tokenizer, ref)
    report["reference"] = {
        **ref_stats, "old_is_live": all(torch.equal(old["tensors"][k], v) for k, v in live1.items()),
        "new_is_live": all(torch.equal(new["tensors"][k], v) for k, v in torch.load(root / "live2.pt").items()),
        "old_differs_from_new": not same(old, new), "files_after_save": sorted(state_files(ref))}

    def outcome(where: Path) -> dict:
        """Which save ``where`` resumes as; then the session goes on, and its next save must commit and
        collect what the crash left (no generation's files but the new manifest's)."""
        verdict = {"outcome": classify(read_back(model, tokenizer, where), old, new)}
        if verdict["outcome"] in ("old", "new"):
            store = TieredStore([DiskTier(where)])
            session = PACESession.resume(SID, model, tokenizer, store=store)
            session.save()
            store.flush()  # the writer has deleted what the save retired
            manifest = store.get("manifest", fingerprint="pace-session-manifest", session_id=SID)[1]
            names = {DiskTier(where).path_for(f"pace:{SID}:{k}").rsplit("/", 1)[-1] for k in manifest["entries"]}
            verdict["leftovers"] = sorted(state_files(where) - names)
            session.cache.unbind()
            store.close()
        return verdict

    report["seconds"]["setup"] = time.perf_counter() - started
    points = list(range(1, ref_stats["io"] + 2))  # the last one is past the save's final call: no kill
    for pair in (points[i:i + 2] for i in range(0, len(points), 2)):  # two at a time: one per core
        pids = {}
        for k in pair:
            where = root / f"kill{k}"
            shutil.copytree(base, where)
            pids[k] = child(lambda: continue_and_save(model, tokenizer, where, TURN2, lambda s: IOCounter(k),
                                                      queue_size=1))
        for k, pid in pids.items():
            code = wait(pid)
            report["kills"].append({"k": k, "exit": code, **outcome(root / f"kill{k}")})
            shutil.rmtree(root / f"kill{k}")

    report["seconds"]["kills"] = time.perf_counter() - started
    rng = random.Random(0)
    for i in range(4):
        where = root / f"random{i}"
        shutil.copytree(base, where)
        ready_r, ready_w = os.pipe()

        def signal_ready(session, w=ready_w):
            os.write(w, b"!")
        pid = child(lambda: continue_and_save(model, tokenizer, where, TURN2, signal_ready))
        os.read(ready_r, 1)
        delay = rng.uniform(0, 1.2 * ref_stats["seconds"])
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        report["random"].append({"delay": delay, "exit": wait(pid), **outcome(where)})
        os.close(ready_r), os.close(ready_w)
        shutil.rmtree(where)

    for r in range(4):
        where = root / f"race{r}"
        shutil.copytree(base, where)
        go_r, go_w = os.pipe()
        ready_r, ready_w = os.pipe()
        pids = []
        for w, text in enumerate(RACE_TURNS):
            def racer(w=w, text=text):
                def barrier(session):
                    os.write(ready_w, b"!")
                    os.read(go_r, 1)
                    time.sleep(RACE_DELAYS[r] * w)

                def saved(session, gen):
                    torch.save({"tensors": layer_tensors(session.cache), "ids": list(session.ids)}, root / f"race{r}-{w}.pt")
                try:
                    continue_and_save(model, tokenizer, where, text, barrier, saved)
                except Exception as e:  # noqa: BLE001 - the loser's error is what the test reads
                    (root / f"race{r}-{w}.err").write_text(f"{type(e).__name__}: {e}")
            pids.append(child(racer))
        os.read(ready_r, 1), os.read(ready_r, 1)
        os.write(go_w, b"!!")
        exits = [wait(p) for p in pids]
        got = read_back(model, tokenizer, where)
        winners = [w for w in range(2) if (root / f"race{r}-{w}.pt").exists()]
        errors = {w: (root / f"race{r}-{w}.err").read_text() for w in range(2) if (root / f"race{r}-{w}.err").exists()}
        matches = []
        for w in winners:
            saved = torch.load(root / f"race{r}-{w}.pt")
            if "refused" not in got and saved["ids"] == got["ids"] and all(
                    torch.equal(saved["tensors"][k], got["tensors"][k]) for k in saved["tensors"]):
                matches.append(w)
        report["races"].append({"exits": exits, "winners": winners, "errors": errors, "resumed_matches": matches,
                                "refused": got.get("refused")})
        for fd in (go_r, go_w, ready_r, ready_w):
            os.close(fd)
        shutil.rmtree(where)

    report["seconds"]["total"] = time.perf_counter() - started
    Path(out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
