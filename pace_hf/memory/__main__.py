"""See and clean what a store holds: ``python -m pace_hf.memory list|inspect|delete|gc --store SPEC``.

A session's store grows with every token its cache evicts (the spill: key and value per layer and KV
head, about 24 KB a token on SmolLM2-135M in bf16) and keeps it after the session ends, until the
session is deleted or its Valkey entries expire (``ValkeyTier(ttl_s=...)``). This command is the size report and
the cleanup::

    python -m pace_hf.memory list --store disk:runs/kv                 # sessions, entries, bytes per tier
    python -m pace_hf.memory inspect agent-42 --store valkey://127.0.0.1:6379 --keys
    python -m pace_hf.memory delete agent-42 old-7 --store disk:runs/kv,valkey://127.0.0.1:6379
    python -m pace_hf.memory delete --all --store disk:runs/kv
    python -m pace_hf.memory gc --store disk:runs/kv --dry-run         # generations no manifest names
    python -m pace_hf.memory list --tenant ada --store valkey://127.0.0.1:6379   # one tenant of pace-serve

``--store`` takes the spelling ``pace-serve --store`` takes (``pace_hf.tiers.spelling``), but only tiers
shared across processes: host memory belongs to the process that holds it. ``delete`` takes each
session's writer lease first, so it refuses (exit status 1, nothing deleted) a session that a live
writer is saving; ``--json`` prints the report for scripts. ``--tenant NAME`` works inside one tenant of
pace-serve's (``--api-keys``): sessions are named as that tenant names them (its ``X-Session-Id``),
``list`` shows only its sessions and ``delete --all`` deletes only them.

``gc`` deletes the entries of save generations that no manifest names: what a save killed before its
manifest left in a session that never saved again, a session whose manifest was lost, or the save that
a damaged manifest named once an older pace_hf had saved over it. Nothing else collects them, and a
server never does: a damaged save is never cleaned up under the operator. Each session is collected under
its writer lease (a live writer's session is skipped, exit status 1); a session whose manifest fails
verification is skipped whole and named (exit status 1): which generation it names cannot be read, so
put the manifest back or ``delete`` the session. Spill entries belong to no generation and are left to
the session's next save (a session in memory may index them in its next save).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .namespace import SERVE_INDEX, TENANT_NAME, belongs_to, scoped, unscoped
from .persist import MANIFEST_FINGERPRINT, MANIFEST_KEY, DamagedSave, current_generation
from ..tiers.errors import IntegrityError, TierError, WriterConflict
from ..tiers.keys import generation_of
from ..tiers.spelling import SPELLINGS, parse_store


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _report_rows(report: dict) -> list[list[str]]:
    rows = [["session", "tier", "entries", "bytes", "generations"]]
    for sid, tiers in report.items():
        for tier, row in tiers.items():
            rows.append([sid, tier, str(row["entries"]), _size(row["bytes"]), " ".join(row["generations"]) or "-"])
    return rows


def _manifest(store, sid: str) -> dict | str | None:
    """The session's save manifest, ``None`` if it has none, or why it cannot be read."""
    try:
        got = store.get(MANIFEST_KEY, fingerprint=MANIFEST_FINGERPRINT, session_id=sid)
    except IntegrityError as e:
        return f"its manifest fails verification ({e})"
    return None if got is None else got[1]


def _usage(store, args, session: str | None = None) -> dict:
    """``store.usage``, within ``--tenant`` (keyed by the tenant's own names) when one is given."""
    report = store.usage(None if session is None else scoped(args.tenant, session))
    if args.tenant is None:
        return report
    return {unscoped(args.tenant, sid): v for sid, v in report.items() if belongs_to(args.tenant, sid)}


def cmd_list(store, args) -> int:
    report = _usage(store, args)
    if args.json:
        print(json.dumps(report, indent=1))
    elif not report:
        print("no sessions in this store")
    else:
        print(_table(_report_rows(report)))
        total = sum(r["bytes"] for tiers in report.values() for r in tiers.values())
        sessions = len(report) - (SERVE_INDEX in report)
        index = f" and pace-serve's conversation index ({SERVE_INDEX})" if SERVE_INDEX in report else ""
        print(f"{sessions} sessions{index}, {_size(total)} in all")
    return 0


def cmd_inspect(store, args) -> int:
    report = _usage(store, args, args.session)
    if not report:
        print(f"no session {args.session!r} in this store" + (f" for tenant {args.tenant!r}" if args.tenant else ""),
              file=sys.stderr)
        return 1
    manifest = _manifest(store, scoped(args.tenant, args.session))
    unreadable = manifest if isinstance(manifest, str) else None
    manifest = None if unreadable else manifest
    current = None if manifest is None else manifest.get("generation")
    keys = sorted((tier, key, n) for _sid, tier, key, n in store.scan(scoped(args.tenant, args.session))) if args.keys else None
    if args.json:
        out = {"session": args.session, "tiers": report[args.session], "current_generation": current,
               "manifest_error": unreadable}
        if manifest is not None:
            out["saved"] = {k: manifest.get(k) for k in ("class", "format", "serial", "step", "budget", "limit")}
        if keys is not None:
            out["keys"] = [{"tier": t, "key": k, "bytes": n} for t, k, n in keys]
        print(json.dumps(out, indent=1))
        return 0
    print(_table(_report_rows(report)))
    if unreadable:
        print(f"no save that resumes: {unreadable}")
    elif manifest is None:
        print("no save: the entries are a session's that never saved (or whose save was deleted)")
    else:
        print(f"current save: {current} ({manifest.get('class')}, save format {manifest.get('format')}, "
              f"step {manifest.get('step')})")
        stale = sorted({g for row in report[args.session].values() for g in row["generations"]} - {current})
        if stale:
            print(f"left by interrupted saves: {' '.join(stale)} (`gc` deletes them)")
    if keys is not None:
        print(_table([["tier", "key", "bytes"]] + [[t, k, _size(n)] for t, k, n in keys]))
    return 0


def cmd_delete(store, args) -> int:
    report = _usage(store, args)
    status = 0
    for sid in list(report) if args.all else args.sessions:
        if sid not in report:
            print(f"no session {sid!r} in this store" + (f" for tenant {args.tenant!r}" if args.tenant else "")
                  + ": nothing deleted", file=sys.stderr)
            status = 1
            continue
        try:
            with store.lease(scoped(args.tenant, sid)):
                store.delete_session(scoped(args.tenant, sid))
        except WriterConflict as e:
            print(f"{sid}: not deleted: {e}", file=sys.stderr)
            status = 1
            continue
        left = store.usage(scoped(args.tenant, sid))
        if left:
            print(f"{sid}: not every entry went ({_table(_report_rows(left))})", file=sys.stderr)
            status = 1
            continue
        freed = sum(r["bytes"] for r in report[sid].values())
        print(f"{sid}: deleted {sum(r['entries'] for r in report[sid].values())} entries, {_size(freed)}")
    return status


def cmd_gc(store, args) -> int:
    report = _usage(store, args)
    status, out = 0, {}
    for sid in args.sessions or list(report):
        full = scoped(args.tenant, sid)
        if sid not in report:
            print(f"no session {sid!r} in this store" + (f" for tenant {args.tenant!r}" if args.tenant else ""),
                  file=sys.stderr)
            status = 1
            continue
        try:
            with store.lease(full):
                current = current_generation(store, full)
                orphans = {}  # key -> (generation, bytes on its largest tier)
                for _sid, _tier, key, n in store.scan(full):
                    gen = generation_of(key)
                    if gen is not None and gen != current:
                        orphans[key] = (gen, max(n, orphans.get(key, (gen, 0))[1]))
                if not args.dry_run:
                    for key in orphans:
                        store.delete(key, session_id=full)
        except (DamagedSave, WriterConflict) as e:
            print(f"{sid}: not collected: {e}", file=sys.stderr)
            status = 1
            continue
        gens = sorted({gen for gen, _ in orphans.values()})
        out[sid] = {"current_generation": current, "orphaned_generations": gens, "entries": len(orphans),
                    "bytes": sum(n for _, n in orphans.values()), "deleted": not args.dry_run}
        if not args.json and orphans:
            print(f"{sid}: {'would delete' if args.dry_run else 'deleted'} {len(orphans)} entries of "
                  f"{' '.join(gens)}, {_size(out[sid]['bytes'])} (its save is {current or 'gone'})")
    if args.json:
        print(json.dumps(out, indent=1))
    elif not any(row["entries"] for row in out.values()):
        print("nothing to collect: every generation is the one its manifest names")
    return status


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", required=True, help=f"the tiers, comma-separated: {SPELLINGS}")
    common.add_argument("--json", action="store_true", help="print the report as JSON")
    common.add_argument("--tenant", help="work inside one pace-serve tenant's sessions (named as it names them)")
    p = argparse.ArgumentParser(prog="python -m pace_hf.memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", parents=[common], help="every session: entries, bytes and generations per tier")
    inspect = sub.add_parser("inspect", parents=[common], help="one session: its tiers, its save, its keys")
    inspect.add_argument("session")
    inspect.add_argument("--keys", action="store_true", help="list every entry with its size")
    delete = sub.add_parser("delete", parents=[common], help="delete sessions (each under its writer lease)")
    delete.add_argument("sessions", nargs="*")
    delete.add_argument("--all", action="store_true", help="delete every session in the store")
    gc = sub.add_parser("gc", parents=[common], help="delete the entries of generations no manifest names")
    gc.add_argument("sessions", nargs="*", help="the sessions to collect (default: every one)")
    gc.add_argument("--dry-run", action="store_true", help="list what would go, delete nothing")
    args = p.parse_args(argv)
    if args.command == "delete" and args.all == bool(args.sessions):
        p.error("delete: name the sessions to delete, or give --all (not both)")
    if args.tenant is not None and not TENANT_NAME.match(args.tenant):
        p.error(f"--tenant: tenant names are 1-32 of A-Z a-z 0-9 _ . -, got {args.tenant!r}")
    try:
        store = parse_store(args.store, strict=True)
    except (ValueError, ImportError) as e:
        p.error(f"--store: {e}")
    try:
        local = [t.name for t in store.tiers if not t.shared_across_processes]
        if len(local) == len(store.tiers):
            p.error(f"--store: tier(s) {local} live in one process's memory; name tiers shared across "
                    "processes (disk:PATH, valkey://...)")
        if local:  # pace-serve's own spelling (host,disk:...): its host tier is in the server's memory
            print(f"python -m pace_hf.memory: skipping tier(s) {local}: they live in the memory of the process that "
                  "holds them; reading the others", file=sys.stderr)
            store.close()
            store = parse_store(",".join(part for part in args.store.split(",")
                                         if not part.strip().startswith("host")), strict=True)
        missing = [t.root for t in store.tiers if getattr(t, "root", None) and not os.path.isdir(t.root)]
        if missing:  # a mistyped path would read as an empty store
            p.error(f"--store: no such directory {missing[0]!r}: no store was ever written there")
        return {"list": cmd_list, "inspect": cmd_inspect, "delete": cmd_delete, "gc": cmd_gc}[args.command](store, args)
    except BrokenPipeError:  # `list | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except TierError as e:
        print(f"python -m pace_hf.memory: {e}", file=sys.stderr)
        return 1
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(main())
