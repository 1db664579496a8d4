"""ValkeyTier: entries in a Valkey (or Redis) server, through valkey-py.

Keys. The tier stores what the store hands it: the store builds the full key
``pace:{session_id}:{key}`` (see ``keys.full_key``), so every session is its own namespace and
``delete_prefix("pace:<session>:")`` drops one session. A value larger than ``chunk_bytes`` is split:
chunk 0 lives under the key itself and starts with the total length (8 bytes, little endian); chunk
``i >= 1`` lives under ``key + "\\0#i"`` (NUL never occurs in a store key, so chunk names cannot collide
with entries). All chunks are written in one MULTI/EXEC transaction (all the entries of one
``put_many`` in one transaction too), chunk 0 last, each with the same
optional TTL (``ttl_s``); chunks of an older, longer value under the same key are unlinked in the same
transaction. A chunk that is missing on read (restart, eviction, TTL) makes the entry a miss; a chunk of
the wrong length makes it truncated data, which the entry checksum rejects.

Why chunks. Measured on this machine, one 75 MB value over loopback with plain valkey-py:
single GET 193 MiB/s, pipelined 16 MiB chunks 189 MiB/s, 1-4 MiB chunks 109-123 MiB/s (valkey-py's
pure-Python reply parser copies every reply several times; pipelining does not help it). The parser, not
the round trips, is the bottleneck. So reads take a fast path: the GETs are sent on a plain socket and
each bulk reply is received with ``recv_into`` straight into its place in one preallocated buffer (one
copy, kernel to the final buffer; no reply parser, no reassembly). That measured 631 MiB/s for the same
value. Chunking keeps every value far below the server's 512 MB bulk limit (a 2K-token span of an 8B
model is 288 MB) and keeps server-side allocations small; with the fast path the chunk GETs are pipelined
(sent in one write, read back to back), so they cost one extra round trip, not one per chunk.
Set ``fast_reads=False`` to read through valkey-py only (TLS URLs always do).

Timeouts. Every request has ``socket_timeout = socket_connect_timeout = timeout_s`` and valkey-py's
retries are off, so a dead or paused server costs at most one timeout per request (the store then marks
the tier unhealthy and backs off). Connection and timeout errors are raised as ``TierUnavailable``; a
server that came back empty just answers misses.

Leases. ``acquire_lease`` is ``SET name token NX PX ttl``: one writer gets it; it expires on its own if the
writer dies. Renewing and releasing compare the token first, in one server-side script, so a writer whose
lease expired can never extend or delete the next writer's.

Eviction. A server under ``maxmemory`` with an eviction policy may drop any entry at any time; a dropped
chunk is a miss, and a save's manifest names every entry it needs, so a resume that misses one refuses.

Valkey Cluster (``valkey+cluster://host:port,host:port,...``: any reachable nodes; the client learns the
rest and the slot map from them). A transaction must stay inside one hash slot, so the tier puts the
quoted session id of every store key in a hash tag (``pace:{sid}:key``): a session's entries, chunks,
manifest and lease all live in one slot, and ``put_many`` writes each session's entries in one
MULTI/EXEC on the node that owns that slot (one transaction per session of the batch, not one for the
batch). Reads are grouped by node and take the same fast path on each node's socket. A slot that moved
(``MOVED``, a resharding) refreshes the slot map and is tried once more. A dead node is a
``TierUnavailable`` for the sessions in its slots, within the timeout, as a dead single server is;
sessions in the other nodes' slots go on being served when the cluster runs with
``cluster-require-full-coverage no``.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Iterable, Iterator

from .base import Tier, check_number
from .errors import TierError, TierUnavailable

try:
    import valkey
    import valkey.cluster
    from valkey import exceptions as _vexc
    from valkey.backoff import NoBackoff
    from valkey.retry import Retry
except ImportError:  # pragma: no cover
    valkey = None
    _vexc = None

CLUSTER_SCHEME = "valkey+cluster://"

_LEN = struct.Struct("<Q")
# Compare-and-act on a lease: only the holder's token may extend or delete it.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
_CHUNK_SEP = b"\x00#"


def _glob_escape(b: bytes) -> bytes:
    out = bytearray()
    for c in b:
        if c in b"*?[]\\":
            out += b"\\"
        out.append(c)
    return bytes(out)


def cluster_nodes(url: str) -> tuple[list[tuple[str, int]], dict]:
    """The ``(host, port)`` nodes and the credentials of ``valkey+cluster://[user:password@]h:p,h:p,...``."""
    rest = url[len(CLUSTER_SCHEME):].rstrip("/")
    auth, _, hosts = rest.rpartition("@")
    nodes = []
    for part in filter(None, (h.strip() for h in hosts.split(","))):
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"bad cluster node {part!r} in {url!r}: give {CLUSTER_SCHEME}host:port,host:port,...")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ValueError(f"{url!r} names no node: give {CLUSTER_SCHEME}host:port,host:port,...")
    user, _, password = auth.partition(":") if ":" in auth else ("", "", auth)
    from urllib.parse import unquote

    return nodes, {k: unquote(v) for k, v in (("username", user), ("password", password)) if v}


def hash_tagged(key: bytes) -> bytes:
    """``pace:{sid}:key`` for the store's ``pace:sid:key`` (the store quotes ``sid``, so it holds no brace):
    a session's keys share one cluster hash slot. Other keys (and prefixes without a session) unchanged."""
    head, sep, rest = key.partition(b":")
    sid, sep2, tail = rest.partition(b":")
    return head + b":{" + sid + b"}:" + tail if sep and sep2 else key


def hash_untagged(key: bytes) -> bytes:
    head, sep, rest = key.partition(b":{")
    sid, sep2, tail = rest.partition(b"}:")
    return head + b":" + sid + b":" + tail if sep and sep2 else key


def _cmd(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n" % len(a))
        out.append(a)
        out.append(b"\r\n")
    return b"".join(out)


class _RawReader:
    """A plain RESP2 socket that sends GETs and receives bulk replies into caller-owned buffers."""

    def __init__(self, kwargs: dict, timeout_s: float):
        path = kwargs.get("path") or kwargs.get("unix_socket_path")
        if path:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout_s)
            s.connect(path)
        else:
            s = socket.create_connection((kwargs.get("host", "localhost"), int(kwargs.get("port", 6379))),
                                         timeout=timeout_s)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(timeout_s)
        self.sock = s
        self._pending = bytearray()
        password, username, db = kwargs.get("password"), kwargs.get("username"), kwargs.get("db") or 0
        if password:
            args = [b"AUTH"] + ([str(username).encode()] if username else []) + [str(password).encode()]
            s.sendall(_cmd(*args))
            self._expect_ok()
        if int(db):
            s.sendall(_cmd(b"SELECT", str(int(db)).encode()))
            self._expect_ok()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _fill(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("server closed the connection")
        self._pending += data

    def _line(self) -> bytes:
        while True:
            i = self._pending.find(b"\r\n")
            if i >= 0:
                line = bytes(self._pending[:i])
                del self._pending[:i + 2]
                return line
            self._fill()

    def _expect_ok(self) -> None:
        line = self._line()
        if not line.startswith(b"+"):
            raise TierError(f"valkey: {line[:200].decode(errors='replace')}")

    def send_gets(self, keys: list[bytes]) -> None:
        self.sock.sendall(b"".join(_cmd(b"GET", k) for k in keys))

    def bulk_len(self) -> int:
        """Read one reply header: the bulk length, or -1 for a null reply."""
        line = self._line()
        if line.startswith(b"$"):
            return int(line[1:])
        if line.startswith(b"-"):
            raise TierError(f"valkey: {line[:200].decode(errors='replace')}")
        raise ConnectionError(f"unexpected reply {line[:50]!r}")

    def read_exact(self, mv: memoryview) -> None:
        """Receive exactly ``len(mv)`` bytes into ``mv`` (buffered bytes first, then ``recv_into``)."""
        n = len(mv)
        take = min(n, len(self._pending))
        if take:
            mv[:take] = self._pending[:take]
            del self._pending[:take]
        got = take
        while got < n:
            r = self.sock.recv_into(mv[got:], min(n - got, 8 << 20))
            if not r:
                raise ConnectionError("server closed the connection")
            got += r

    def read_into(self, mv: memoryview) -> None:
        """Receive exactly ``len(mv)`` body bytes into ``mv``, then the CRLF."""
        self.read_exact(mv)
        while len(self._pending) < 2:
            self._fill()
        del self._pending[:2]

    def skip(self, n: int) -> None:
        self.read_into(memoryview(bytearray(n)))


class ValkeyTier(Tier):
    """Entries in a Valkey (or Redis) server.

    Args:
        url: the server, ``valkey://host:port/db``, ``redis://...``, ``valkeys://`` (TLS) or
            ``valkey+unix:///path/to.sock``; a password goes in the URL. A Valkey Cluster:
            ``valkey+cluster://host:port,host:port,...`` (see the module docstring).
        ttl_s: expire every entry this many seconds after it was written (``None``: never). A session
            whose entries expire cannot be resumed: resume refuses, naming the missing entry.
        timeout_s: seconds per request (connect, send, reply); ``None`` takes the store's ``timeout_s``.
        chunk_bytes: values above this are split into chunks of this size (see the module docstring).
        fast_reads: read replies straight into place on a plain socket (``False``: through valkey-py).
        name: the tier's name in the store's stats and confirmations (unique within a store).
    """

    durable = True
    shared_across_processes = True
    supports_lease = True

    def __init__(self, url: str = "valkey://127.0.0.1:6379", *, ttl_s: float | None = None,
                 timeout_s: float | None = None, chunk_bytes: int = 16 << 20, fast_reads: bool = True,
                 name: str = "valkey"):
        if valkey is None:
            raise ImportError("ValkeyTier needs valkey-py, which the core install leaves out: pip install pace_hf[valkey]")
        if chunk_bytes < 1024:
            raise ValueError("chunk_bytes must be at least 1024")
        if ttl_s is not None:  # a ttl of 0 or below is not "never" (that is None): entries would go at once
            check_number(ttl_s, "ValkeyTier ttl_s (None: never expire)", above=True)
        if timeout_s is not None:
            check_number(timeout_s, "ValkeyTier timeout_s", above=True)
        self.name = name
        self.url = url
        self.cluster = url.startswith(CLUSTER_SCHEME)
        self.ttl_s = ttl_s
        self.chunk_bytes = int(chunk_bytes)
        self._fast_reads_wanted = fast_reads
        self._raw: dict[tuple, list[_RawReader]] = {}  # per node: (host, port) or the socket path
        self._raw_lock = threading.Lock()
        self.client = None
        self._own_timeout = timeout_s is not None  # else the store's timeout, through set_default_timeout
        self._connect(timeout_s if timeout_s is not None else 2.0)

    # -- setup -------------------------------------------------------------------------------------
    def set_default_timeout(self, timeout_s: float) -> None:
        if not self._own_timeout and float(timeout_s) != self.timeout_s:
            self._connect(timeout_s)

    def _connect(self, timeout_s: float) -> None:
        """(Re)create the client with ``timeout_s`` per request."""
        self.timeout_s = float(timeout_s)
        old = self.client
        # One immediate retry on a *connection* error (a pooled connection that a server restart
        # closed, or a refused connect), never on a timeout: a restarted server answers at once, a hung
        # one costs one timeout, not two.
        timeouts = {"socket_timeout": self.timeout_s, "socket_connect_timeout": self.timeout_s}
        if self.cluster:
            nodes, auth = cluster_nodes(self.url)
            try:  # the client reads the slot map from the first node that answers
                self.client = valkey.cluster.ValkeyCluster(
                    startup_nodes=[valkey.cluster.ClusterNode(h, p) for h, p in nodes],
                    cluster_error_retry_attempts=1, **timeouts, **auth)
            except self._errors() as e:
                raise TierUnavailable(f"valkey cluster {self.url}: no node answered: {e}") from e
            self.fast_reads = self._fast_reads_wanted
        else:
            self.client = valkey.Valkey.from_url(
                self.url, **timeouts, retry_on_timeout=False, health_check_interval=0,
                retry=Retry(NoBackoff(), 1), retry_on_error=[_vexc.ConnectionError])
            kwargs = self.client.connection_pool.connection_kwargs
            self.fast_reads = (self._fast_reads_wanted and not kwargs.get("ssl")
                               and self.client.connection_pool.connection_class.__name__ in
                               ("Connection", "UnixDomainSocketConnection"))
        self._drop_raw()
        if old is not None:
            old.close()

    def _drop_raw(self) -> None:
        with self._raw_lock:
            raws, self._raw = self._raw, {}
        for pool in raws.values():
            for r in pool:
                r.close()

    def _errors(self):
        return (_vexc.ConnectionError, _vexc.TimeoutError, OSError, ConnectionError,
                _vexc.ClusterError, _vexc.ValkeyClusterException)  # a cluster that cannot serve the slot

    # -- keys and nodes: one server, or the node of each key's slot in a cluster ---------------------
    def _key(self, key: str) -> bytes:
        return hash_tagged(key.encode()) if self.cluster else key.encode()

    def _node(self, key: bytes):
        """The plain client that serves ``key``: the server, or the cluster node owning its slot."""
        return self.client.get_valkey_connection(self.client.get_node_from_key(key)) if self.cluster else self.client

    def _grouped(self, keys: list[bytes], by_slot: bool = False) -> list[tuple[object, list[int]]]:
        """``(client, indices)`` of ``keys`` per node (``by_slot``: per hash slot, what a transaction needs)."""
        if not self.cluster:
            return [(self.client, list(range(len(keys))))]
        groups: dict[object, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(self.client.keyslot(k) if by_slot else self.client.get_node_from_key(k).name, []).append(i)
        return [(self._node(keys[idx[0]]), idx) for idx in groups.values()]

    def _on_nodes(self, call):
        """``call()``, once more after refreshing the slot map if a slot moved (a resharding)."""
        try:
            return call()
        except (_vexc.MovedError, _vexc.AskError):
            if not self.cluster:
                raise
            self.client.nodes_manager.initialize()
            return call()

    def _chunk_key(self, base: bytes, i: int) -> bytes:
        return base if i == 0 else base + _CHUNK_SEP + str(i).encode()

    def _n_chunks(self, total: int) -> int:
        return max(1, -(-total // self.chunk_bytes))

    def _ex(self) -> dict:
        return {"px": max(1, int(self.ttl_s * 1000))} if self.ttl_s else {}

    # -- protocol ----------------------------------------------------------------------------------
    def put(self, key: str, data) -> None:
        (err,) = self.put_many([(key, data)])
        if err is not None:
            raise err

    def put_many(self, items: Iterable[tuple[str, object]]) -> list:
        """Every entry in one transaction (one round trip to learn the chunk counts of the values they
        replace, one for the transaction): all are written, or none and each gets the error."""
        items = [(self._key(key), memoryview(data).cast("B")) for key, data in items]
        if not items:
            return []
        what = items[0][0].decode(errors="replace") + (f" and {len(items) - 1} more" if len(items) > 1 else "")
        out: list = [None] * len(items)
        try:
            for client, idx in self._grouped([k for k, _ in items], by_slot=True):
                group = [items[i] for i in idx]
                self._on_nodes(lambda: self._put_transaction(client, group))
        except self._errors() as e:
            raise TierUnavailable(f"valkey put {what!r}: {e}") from e
        except _vexc.ValkeyError as e:
            err = TierError(f"valkey put {what!r}: {e}")
            return [err] * len(items)
        return out

    def _put_transaction(self, client, items: list[tuple[bytes, memoryview]]) -> None:
        """One session's entries (one slot) in one MULTI/EXEC: the chunk counts of the values they replace,
        then the transaction."""
        C = self.chunk_bytes
        p = client.pipeline(transaction=False)
        for base, _mv in items:
            p.getrange(base, 0, _LEN.size - 1)
        olds = p.execute()
        p = client.pipeline(transaction=True)
        chunks: dict[bytes, int] = {}  # a key given twice: the second replaces the first's chunks
        for (base, mv), old in zip(items, olds):
            n = self._n_chunks(len(mv))
            old_n = chunks.get(base) or (self._n_chunks(_LEN.unpack(old)[0]) if len(old) == _LEN.size else 1)
            chunks[base] = n
            for i in range(old_n - 1, n - 1, -1):
                p.unlink(self._chunk_key(base, i))
            for i in range(n - 1, 0, -1):
                p.set(self._chunk_key(base, i), mv[i * C:(i + 1) * C], **self._ex())
            p.set(base, _LEN.pack(len(mv)) + bytes(mv[:C]), **self._ex())
        p.execute()


    def get(self, key: str) -> bytearray | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str]) -> list[bytearray | None]:
        if not keys:
            return []
        bases = [self._key(k) for k in keys]
        out: list[bytearray | None] = [None] * len(bases)
        try:
            for client, idx in self._grouped(bases):
                group = [bases[i] for i in idx]
                read = self._get_many_raw if self.fast_reads else self._get_many_client
                for i, value in zip(idx, self._on_nodes(lambda: read(client, group))):
                    out[i] = value
            return out
        except self._errors() as e:
            raise TierUnavailable(f"valkey get: {e}") from e
        except _vexc.ValkeyError as e:
            raise TierError(f"valkey get: {e}") from e

    def _get_many_client(self, client, bases: list[bytes]) -> list[bytearray | None]:
        p = client.pipeline(transaction=False)
        for b in bases:
            p.get(b)
        firsts = p.execute()
        out: list[bytearray | None] = []
        plan = []
        for b, first in zip(bases, firsts):
            if first is None or len(first) < _LEN.size:
                out.append(None if first is None else bytearray(first[_LEN.size:]))
                continue
            total = _LEN.unpack_from(first)[0]
            head = first[_LEN.size:]
            buf = bytearray(total) if len(head) <= total else bytearray(len(head))
            buf[:len(head)] = head
            out.append(buf)
            plan.append((len(out) - 1, b, total))
        p = client.pipeline(transaction=False)
        wanted = []
        for idx, b, total in plan:
            for i in range(1, self._n_chunks(total)):
                p.get(self._chunk_key(b, i))
                wanted.append((idx, i, total))
        replies = p.execute() if wanted else []
        C = self.chunk_bytes
        for (idx, i, total), r in zip(wanted, replies):
            if out[idx] is None:
                continue
            if r is None:
                out[idx] = None
                continue
            expect = min(C, total - i * C)
            if len(r) != expect:
                out[idx] = out[idx][:i * C]  # truncated data: the entry checksum rejects it
                continue
            out[idx][i * C:i * C + expect] = r
        return out

    def _take_raw(self, client) -> tuple[tuple, _RawReader]:
        kwargs = client.connection_pool.connection_kwargs
        where = (kwargs.get("path") or kwargs.get("unix_socket_path"), kwargs.get("host"), kwargs.get("port"))
        with self._raw_lock:
            if self._raw.get(where):
                return where, self._raw[where].pop()
        return where, _RawReader(kwargs, self.timeout_s)

    def _give_raw(self, where: tuple, r: _RawReader) -> None:
        with self._raw_lock:
            pool = self._raw.setdefault(where, [])
            if len(pool) < 8:
                pool.append(r)
                return
        r.close()

    def _get_many_raw(self, client, bases: list[bytes]) -> list[bytearray | None]:
        for attempt in (0, 1):
            where, r = self._take_raw(client)
            try:
                out = self._raw_round(r, bases)
            except (ConnectionError, BrokenPipeError) as e:
                # a pooled socket that a server restart closed: retry once on a fresh one (not on a
                # timeout: that is a hung server, and one timeout is all a request may cost)
                r.close()
                if attempt or isinstance(e, socket.timeout):
                    raise
                self._drop_raw()
                continue
            except BaseException:
                r.close()
                raise
            self._give_raw(where, r)
            return out
        raise AssertionError("unreachable")

    def _raw_round(self, r: _RawReader, bases: list[bytes]) -> list[bytearray | None]:
        C = self.chunk_bytes
        out: list[bytearray | None] = []
        rest = []  # (index in out, base, total)
        r.send_gets(bases)
        for b in bases:
            n = r.bulk_len()
            if n < 0:
                out.append(None)
                continue
            if n < _LEN.size:
                r.skip(n)
                out.append(bytearray())  # malformed: truncated entry
                continue
            hdr = bytearray(_LEN.size)  # the length leads chunk 0; the body then goes straight in place
            r.read_exact(memoryview(hdr))
            total = _LEN.unpack(hdr)[0]
            body = n - _LEN.size
            if body > total:  # length field disagrees with the data: hand back what came, unverifiable
                buf = bytearray(body)
                r.read_into(memoryview(buf))
                out.append(buf)
                continue
            buf = bytearray(total)
            r.read_into(memoryview(buf)[:body])
            out.append(buf)
            if self._n_chunks(total) > 1:
                if body != C:
                    out[-1] = buf[:body]
                else:
                    rest.append((len(out) - 1, b, total))
        if not rest:
            return out
        wanted = [(idx, b, total, i) for idx, b, total in rest for i in range(1, self._n_chunks(total))]
        r.send_gets([self._chunk_key(b, i) for _idx, b, _t, i in wanted])
        for idx, _b, total, i in wanted:
            n = r.bulk_len()
            if n < 0:
                out[idx] = None
                continue
            expect = min(C, total - i * C)
            buf = out[idx]
            if buf is None or n != expect or len(buf) != total:
                r.skip(n)
                if buf is not None and len(buf) == total:
                    out[idx] = buf[:i * C]  # truncated: rejected by the checksum
                continue
            r.read_into(memoryview(buf)[i * C:i * C + n])
        return out

    def delete(self, key: str) -> None:
        base = self._key(key)

        def unlink():
            client = self._node(base)
            old = client.getrange(base, 0, _LEN.size - 1)
            n = self._n_chunks(_LEN.unpack(old)[0]) if len(old) == _LEN.size else 1
            client.unlink(*[self._chunk_key(base, i) for i in range(n)])
        try:
            self._on_nodes(unlink)
        except self._errors() as e:
            raise TierUnavailable(f"valkey delete {key!r}: {e}") from e

    def delete_prefix(self, prefix: str) -> int:
        pattern = _glob_escape(self._key(prefix)) + b"*"
        n = 0
        try:
            batch = []
            for k in self.client.scan_iter(match=pattern, count=1000):
                batch.append(k)
                if len(batch) >= 1000:
                    n += self.client.unlink(*batch)
                    batch = []
            if batch:
                n += self.client.unlink(*batch)
        except self._errors() as e:
            raise TierUnavailable(f"valkey delete_prefix {prefix!r}: {e}") from e
        return n

    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """SCAN for the prefix, then STRLEN of every key found (pipelined); a value's chunks count
        toward its entry."""
        pattern = _glob_escape(self._key(prefix)) + b"*"
        sizes: dict[bytes, int] = {}
        try:
            found = list(self.client.scan_iter(match=pattern, count=1000))
            for start in range(0, len(found), 1000):
                batch = found[start:start + 1000]
                p = self.client.pipeline(transaction=False)
                for k in batch:
                    p.strlen(k)
                for k, n in zip(batch, p.execute()):
                    base = k.split(_CHUNK_SEP, 1)[0]
                    base = hash_untagged(base) if self.cluster else base
                    sizes[base] = sizes.get(base, 0) + int(n)
        except self._errors() as e:
            raise TierUnavailable(f"valkey scan {prefix!r}: {e}") from e
        return iter([(k.decode("utf-8", errors="replace"), n) for k, n in sizes.items()])

    def _lease_call(self, what: str, call):
        try:
            return call()
        except self._errors() as e:
            raise TierUnavailable(f"valkey lease {what}: {e}") from e
        except _vexc.ValkeyError as e:
            raise TierError(f"valkey lease {what}: {e}") from e

    def acquire_lease(self, name: str, token: str, ttl_s: float) -> bool:
        px = max(1, int(ttl_s * 1000))
        return bool(self._lease_call("acquire", lambda: self.client.set(self._key(name), token, nx=True, px=px)))

    def renew_lease(self, name: str, token: str, ttl_s: float) -> bool:
        px = str(max(1, int(ttl_s * 1000)))
        return bool(self._lease_call("renew", lambda: self.client.eval(_RENEW, 1, self._key(name), token, px)))

    def release_lease(self, name: str, token: str) -> None:
        self._lease_call("release", lambda: self.client.eval(_RELEASE, 1, self._key(name), token))

    def close(self) -> None:
        self._drop_raw()
        if self.client is not None:
            self.client.close()
