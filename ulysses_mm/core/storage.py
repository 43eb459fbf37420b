"""Where files live: local paths or fsspec URLs, written so nothing partial is ever visible.

General I/O on the bottom floor: datasets (``data``), fitted codebooks (``modalities``),
checkpoints and metrics (``train``) all write through it. Of the package it imports only
the error types, so a failed remote read is one :class:`ReadError` line whatever the
backend raised.

A :class:`Location` is a path or URL together with its fsspec storage options and read
timeouts: the one value the rest of the package passes around and reads, writes, lists and
removes through, so the options travel with the URL instead of beside it. The module's
free functions need no options: they work on names (:func:`is_url`, :func:`join`,
:func:`temp_name`) or on local files (:func:`atomic_local_file`, :func:`atomic_local_dir`,
:func:`atomic_write_local`), and :func:`list_inputs` expands input patterns.

Every write goes to a temporary name in the destination's own directory (``.NAME.XXXX.tmp``)
and is then renamed (local: ``os.replace``) or moved (object stores: upload to the temporary
key, then ``fs.mv``, a server-side copy), so a reader listing the directory sees either the
previous object or the complete new one. A run killed mid-write leaves only ``*.tmp`` names,
which :meth:`Location.remove_stale_temps` clears on the next run.

Inputs are expanded here too (paths, globs, directories, URL globs) so the pipeline works
the same on a laptop and against a bucket.
"""

from __future__ import annotations

import contextlib
import glob as _glob
import hashlib
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import fsspec
from fsspec.asyn import sync

from ulysses_mm.core.errors import StorageError, first_line

_TEMP_RE = re.compile(r"^\..+\.[0-9a-z_]+\.tmp$")
_CHUNK = 8 << 20


class _OrphanedClientWrite(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for an aiohttp request body
    still being written when its server went away: the request itself already failed and
    is reported once, in one line, by the caller (:func:`remote_error`); the orphaned
    writer task's traceback would follow it on the terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (
            str(record.msg).startswith("Task exception was never retrieved")
            and exc is not None
            and type(exc).__module__.startswith("aiohttp")
        )


logging.getLogger("asyncio").addFilter(_OrphanedClientWrite())


# ------------------------------------------------------------------------ names


def is_url(location: str) -> bool:
    """True for ``proto://...`` (``file://`` included)."""
    return "://" in location


def join(location: str, name: str) -> str:
    """``location/name`` for paths and URLs alike."""
    if is_url(location):
        return location.rstrip("/") + "/" + name
    return os.path.join(location, name)


def temp_name(name: str) -> str:
    """A temporary sibling name of ``name`` that :meth:`Location.remove_stale_temps`
    recognises."""
    return f".{name}.{uuid.uuid4().hex[:12]}.tmp"


def is_temp_name(name: str) -> bool:
    return bool(_TEMP_RE.match(name))


# ------------------------------------------------------------------------ locations


@dataclass(frozen=True)
class Location:
    """A path or fsspec URL with what reaches it: the fsspec storage options (credentials,
    an endpoint) and the (connect, read) timeouts of a remote read (None: unbounded).

    The one value passed wherever a file or object is read or written, so the options
    and timeouts travel with the URL instead of beside it; :meth:`join` and :meth:`at`
    make siblings that keep them."""

    url: str
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    timeouts: tuple[float, float] | None = None

    def __str__(self) -> str:
        return self.url

    def at(self, url: str) -> Location:
        """Another location reached the same way (same options and timeouts)."""
        return replace(self, url=url)

    def join(self, name: str) -> Location:
        """``self/name``, reached the same way."""
        return self.at(join(self.url, name))

    def with_timeouts(self, timeouts: tuple[float, float] | None) -> Location:
        return replace(self, timeouts=timeouts)

    @property
    def is_local(self) -> bool:
        """True for plain paths and ``file://`` URLs."""
        return not is_url(self.url) or self.url.startswith("file://")

    @property
    def local_path(self) -> Path:
        """The filesystem path of a local location (plain path or ``file://`` URL)."""
        if self.url.startswith("file://"):
            return Path(self.url[len("file://") :])
        if is_url(self.url):
            raise ValueError(f"{self.url} is not a local path")
        return Path(self.url)

    @property
    def name(self) -> str:
        """The last part of the path or URL."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    def filesystem(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """(the fsspec filesystem, the path within it), opened with the options (and the
        timeouts, in the backend's form, when set)."""
        opts = _timeout_options(self.url, self.options, self.timeouts)
        fs, path = fsspec.core.url_to_fs(self.url, **opts)
        if self.timeouts and getattr(fs, "protocol", None) and "s3" in fs.protocol:
            fs.retries = 1  # type: ignore[attr-defined]  # the caller owns the retry policy
        return fs, path

    def exists(self) -> bool:
        """Whether it exists; a remote probe is bounded by the timeouts when set."""
        if self.is_local:
            return self.local_path.exists()
        fs, path = self.filesystem()
        return bool(fs.exists(path))

    def read_bytes(self) -> bytes:
        """The bytes here. The timeouts bound a remote read, so a server that accepts and
        then stalls raises instead of holding the caller. A remote read that fails raises
        one :class:`ReadError` line (an ``OSError``), whatever the backend raised."""
        if self.is_local:
            return self.local_path.read_bytes()
        fs, path = self.filesystem()
        try:
            return fs.cat_file(path)
        except StorageError:
            raise
        # transport faults arrive as many types (OSError, aiohttp, botocore, asyncio timeouts)
        except Exception as e:
            raise remote_error(e, self.url, self.timeouts) from e

    def read_bytes_capped(self, max_bytes: int) -> bytes:
        """Like :meth:`read_bytes`, but never more than ``max_bytes``: the size (``stat``,
        fsspec ``info``, an HTTP Content-Length) is checked before the body is read, and a
        body of unknown size is read in chunks and given up on past the cap. Over it:
        :class:`TooLargeError` (its message names the size or says it is over the cap)."""

        def over(size: int | None) -> TooLargeError:
            said = f"{size} bytes" if size is not None else f"more than {max_bytes} bytes"
            return TooLargeError(f"{said}, over the cap of {max_bytes} bytes", size, max_bytes)

        def bounded(f: IO[bytes]) -> bytes:
            parts, total = [], 0
            while chunk := f.read(min(_CHUNK, max_bytes + 1 - total)):
                parts.append(chunk)
                total += len(chunk)
                if total > max_bytes:
                    raise over(None)
            return b"".join(parts)

        if self.is_local:
            with open(self.local_path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > max_bytes:
                    raise over(size)
                return bounded(f)
        fs, path = self.filesystem()
        try:
            if self.url.startswith(("http://", "https://")):
                # One streamed GET: fsspec's HTTP open would first ask for the size (a HEAD,
                # then a GET), each waiting out a stalled server's read timeout; the answer's
                # Content-Length is checked instead. The response is released however the
                # read ends (fsspec's stream file leaves an error status's connection open,
                # which aiohttp reports on stderr when it is collected).
                async def get() -> bytes:
                    session = await fs.set_session()
                    async with session.get(fs.encode_url(path), **fs.kwargs) as r:
                        fs._raise_not_found_for_status(r, path)
                        length = r.headers.get("Content-Length", "")
                        if length.isdigit() and int(length) > max_bytes:
                            raise over(int(length))
                        parts, total = [], 0
                        async for chunk in r.content.iter_chunked(_CHUNK):
                            parts.append(chunk)
                            total += len(chunk)
                            if total > max_bytes:
                                raise over(None)
                        return b"".join(parts)

                return bytes(sync(fs.loop, get))
            size = fs.info(path).get("size")
            if isinstance(size, int) and size > max_bytes:
                raise over(size)
            with fs.open(path, "rb") as f:
                return bounded(f)
        except StorageError:
            raise
        except Exception as e:  # as in read_bytes: one ReadError line
            raise remote_error(e, self.url, self.timeouts) from e

    def atomic_write(self, data: bytes) -> None:
        """Write ``data`` here; the final name only ever holds complete bytes."""
        if self.is_local:
            atomic_write_local(self.local_path, data)
            return
        fd, tmp = tempfile.mkstemp(suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            self.publish(Path(tmp))
        finally:
            Path(tmp).unlink(missing_ok=True)

    def publish(self, local_file: Path) -> None:
        """Make the finished ``local_file`` visible here in one step.

        A local destination is renamed into place (``local_file`` must be on the same
        filesystem, e.g. a temporary name in the destination directory); a remote one is
        uploaded to a temporary key, then moved, and the local file is removed."""
        if self.is_local:
            dest = self.local_path
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(local_file, dest)
            _fsync_dir(dest.parent)
            return
        fs, path = self.filesystem()
        parent, _, name = path.rpartition("/")
        tmp = f"{parent}/{temp_name(name)}" if parent else temp_name(name)
        try:
            fs.put_file(str(local_file), tmp)
            fs.mv(tmp, path)
        except BaseException:
            try:
                if fs.exists(tmp):
                    fs.rm(tmp)
            except Exception:
                pass
            raise
        local_file.unlink(missing_ok=True)

    def makedirs(self) -> None:
        if self.is_local:
            self.local_path.mkdir(parents=True, exist_ok=True)
            return
        fs, path = self.filesystem()
        fs.makedirs(path, exist_ok=True)

    def missing_dirs(self) -> list[str]:
        """The directories :meth:`makedirs` would create, deepest first (for a URL: the
        location itself, if absent)."""
        if self.is_local:
            path = self.local_path.absolute()
            return [str(p) for p in (path, *path.parents) if not p.exists()]
        return [] if self.exists() else [self.url]

    def remove(self) -> None:
        """Delete the file or object if it exists."""
        if self.is_local:
            self.local_path.unlink(missing_ok=True)
            return
        fs, path = self.filesystem()
        if fs.exists(path):
            fs.rm(path)

    def remove_empty_dir(self) -> bool:
        """Remove the directory (or URL prefix) if it is empty; True if it is gone."""
        if self.is_local:
            try:
                self.local_path.rmdir()
            except FileNotFoundError:
                return True
            except OSError:  # not empty
                return False
            return True
        fs, path = self.filesystem()
        if not fs.exists(path):
            return True
        if fs.ls(path, detail=False):
            return False
        try:
            fs.rmdir(path)
        except (OSError, NotImplementedError):
            return False
        return not fs.exists(path)

    def list_names(self) -> list[str]:
        """Names of the files directly inside this directory or URL prefix ([] if absent)."""
        return self._list(dirs=False)

    def list_dirs(self) -> list[str]:
        """Names of the directories (URL prefixes) directly inside ([] if absent)."""
        return self._list(dirs=True)

    def _list(self, dirs: bool) -> list[str]:
        if self.is_local:
            d = self.local_path
            if not d.is_dir():
                return []
            return sorted(p.name for p in d.iterdir() if (p.is_dir() if dirs else p.is_file()))
        fs, path = self.filesystem()
        if not fs.exists(path):
            return []
        entry_type = "directory" if dirs else "file"
        return sorted(
            str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
            for e in fs.ls(path, detail=True)
            if e.get("type") == entry_type
        )

    def remove_stale_temps(self) -> int:
        """Remove temporary names a killed run left here; returns how many."""
        stale = [n for n in self.list_names() if is_temp_name(n)]
        for name in stale:
            self.join(name).remove()
        return len(stale)

    def open_input(self) -> IO[bytes]:
        """A binary file object that reads this front to back: a local file, or an object
        read through ranged requests in blocks of a few MiB (never copied whole)."""
        if self.is_local:
            return open(self.local_path, "rb")
        fs, path = self.filesystem()
        return fs.open(path, "rb", block_size=_CHUNK, cache_type="readahead")

    def fetch(self, dest_dir: Path) -> Path:
        """A local file with the content here (itself when local; a copy in ``dest_dir``
        keeping the file name, so tokenizers can still route on the suffix)."""
        if self.is_local:
            return self.local_path
        fs, path = self.filesystem()
        dest_dir.mkdir(parents=True, exist_ok=True)
        dest = dest_dir / path.rstrip("/").rsplit("/", 1)[-1]
        with fs.open(path, "rb") as src, atomic_local_file(dest) as out:  # whole or absent
            shutil.copyfileobj(src, out, _CHUNK)
        return dest

    def size_and_sha256(self) -> tuple[int, str]:
        """(bytes, sha256) of the file or object, read in chunks."""
        h, size = hashlib.sha256(), 0
        with self.open_input() as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                size += len(chunk)
        return size, h.hexdigest()

    def expand(self) -> list[InputFile]:
        """The input files this pattern names (see :func:`list_inputs`; braces aside)."""
        if self.is_local:
            p = str(self.local_path)
            if os.path.isdir(p):
                return [
                    _local_input(str(f))
                    for f in Path(p).rglob("*")
                    if f.is_file()
                    and not any(part.startswith(".") for part in f.relative_to(p).parts)
                ]
            if _glob.has_magic(p):
                return [
                    _local_input(f)
                    for f in _glob.glob(p, recursive=True)
                    if os.path.isfile(f) and not os.path.basename(f).startswith(".")
                ]
            return [_local_input(p)] if os.path.isfile(p) else []
        fs, path = self.filesystem()
        infos: dict[str, Any]
        try:
            if _glob.has_magic(path):
                infos = fs.glob(path, detail=True)
            elif fs.isdir(path):
                infos = fs.find(path, detail=True)
            elif fs.exists(path):
                infos = {path: fs.info(path)}
            else:
                infos = {}
        except Exception as e:  # a transport's faults have no common base: name the source
            raise StorageError(f"cannot list {self.url}: {remote_error(e, self.url)}") from None
        return [
            InputFile(fs.unstrip_protocol(q), int(info.get("size") or 0), _identity(info))
            for q, info in infos.items()
            if info.get("type", "file") == "file"
            and not q.rstrip("/").rsplit("/", 1)[-1].startswith(".")
        ]


def as_location(where: Location | str) -> Location:
    """``where`` as a :class:`Location` (a plain path or URL: no options, no timeouts)."""
    return where if isinstance(where, Location) else Location(where)


# ------------------------------------------------------------------------ local files


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_local_file(path: str | Path) -> Iterator[IO[bytes]]:
    """``with atomic_local_file(p) as f: f.write(...)``: the bytes go to a temporary
    sibling, which is fsync-ed and renamed onto ``path`` only if the block succeeds, so
    readers see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / temp_name(path.name)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_local_dir(path: str | Path, replace: bool = False) -> Iterator[Path]:
    """``with atomic_local_dir(p) as tmp: <write files into tmp>``: a folder filled in a
    temporary sibling and renamed onto ``path`` only if the block succeeds, so ``path`` is
    whole or absent (``replace``: an existing ``path`` goes first; else it must be empty
    or absent). The folder and its files take the modes of a plain ``mkdir`` and
    ``open`` (0777 / 0666 less the umask), not the 0700 / 0600 that ``mkdtemp`` and some
    writers use."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        umask = _umask()
        tmp.chmod(0o777 & ~umask)
        for f in tmp.rglob("*"):
            f.chmod((0o777 if f.is_dir() else 0o666) & ~umask)
        if path.exists():
            if replace:
                shutil.rmtree(path)
            else:
                path.rmdir()  # an empty folder only
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(path.parent)


def _umask() -> int:
    """The process's umask (read by setting it, then putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_local(path: str | Path, data: bytes | memoryview) -> None:
    """Write ``path`` through a temporary sibling and ``os.replace``."""
    with atomic_local_file(path) as f:
        f.write(data)


# ------------------------------------------------------------------------ remote faults


class TooLargeError(StorageError):
    """An object is bigger than the caller's cap; ``size`` is its size when known."""

    def __init__(self, message: str, size: int | None, cap: int) -> None:
        super().__init__(message)
        self.size = size
        self.cap = cap


class ReadError(StorageError):
    """A remote read failed; ``status`` is the HTTP status when the server answered one,
    and ``retryable`` says whether asking again can help (a timeout, a reset, a 5xx, 408
    or 429 can; any other 4xx, a missing object or a refused permission cannot)."""

    def __init__(self, message: str, status: int | None = None, retryable: bool = True) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable


class MissingError(ReadError, FileNotFoundError):
    """The server says the object does not exist (HTTP 404, S3 NoSuchKey)."""


def remote_error(
    e: BaseException, location: str, timeouts: tuple[float, float] | None = None
) -> ReadError:
    """``e``, raised by a remote read of ``location``, as one :class:`ReadError` line
    (``Type: message`` for transport faults, ``HTTP 500 Internal Server Error`` for a
    status, the URL not repeated: the caller names it). A timeout of a read bounded by
    ``timeouts`` (connect, read seconds) says which bound it ran into."""
    status = getattr(e, "status", None)  # aiohttp.ClientResponseError
    if not isinstance(status, int):
        response = getattr(e, "response", None)  # botocore.exceptions.ClientError
        meta = response.get("ResponseMetadata", {}) if isinstance(response, dict) else {}
        status = meta.get("HTTPStatusCode") if isinstance(meta, dict) else None
    if isinstance(status, int):
        reason = str(getattr(e, "message", "") or "").strip().splitlines()
        text = f"HTTP {status}" + (f" {reason[0]}" if reason else "")
        error = MissingError if status == 404 else ReadError
        return error(text, status, retryable=status >= 500 or status in (408, 429))
    if isinstance(e, FileNotFoundError):
        return MissingError("not found (HTTP 404)", 404, retryable=False)
    if isinstance(e, PermissionError):
        return ReadError(f"access denied (HTTP 403): {first_line(e)}", 403, retryable=False)
    if timeouts and _is_timeout(e):
        connect_s, read_s = timeouts
        return ReadError(
            f"no answer within the timeouts (connect {connect_s:g} s, read {read_s:g} s of "
            f"silence): {first_line(e)}"
        )
    return ReadError(first_line(e))


def _is_timeout(e: BaseException) -> bool:
    """A timeout from any transport: asyncio's and fsspec's (http), aiohttp's, botocore's
    (s3: ReadTimeoutError, ConnectTimeoutError), the builtin ``TimeoutError``."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:  # the cause chain: fsspec wraps them
        seen.add(id(cur))
        if isinstance(cur, TimeoutError) or "Timeout" in type(cur).__name__:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _timeout_options(
    location: str, options: Mapping[str, Any], timeouts: tuple[float, float] | None
) -> dict[str, Any]:
    """``options`` plus the connect and read timeouts (when set) in the form the
    location's fsspec backend takes: an aiohttp ``ClientTimeout`` for http(s)
    (``sock_read`` is the longest silence between bytes), botocore's
    ``connect_timeout``/``read_timeout`` without its own retries for s3, ``timeout`` for
    gcs. Values the caller set already are kept.

    One remote read then takes at most ``connect_s + read_s`` of silence before it
    raises; the caller's retries multiply that bound."""
    opts = dict(options)
    if timeouts is None:
        return opts
    connect_s, read_s = timeouts
    proto = location.split("://", 1)[0] if is_url(location) else "file"
    if proto in ("http", "https"):
        import aiohttp  # lazy: only an http(s) read with timeouts needs it

        client = dict(opts.get("client_kwargs") or {})
        client.setdefault(
            "timeout", aiohttp.ClientTimeout(total=None, sock_connect=connect_s, sock_read=read_s)
        )
        opts["client_kwargs"] = client
    elif proto in ("s3", "s3a"):
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("connect_timeout", connect_s)
        config.setdefault("read_timeout", read_s)
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        opts["config_kwargs"] = config
    elif proto in ("gs", "gcs"):
        opts.setdefault("timeout", connect_s + read_s)
    return opts


# ------------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class InputFile:
    """An input as listed: where it is, its size, and what identifies its content cheaply
    (size and mtime, or the object store's ETag / generation), from the listing itself."""

    location: str
    size: int
    identity: dict[str, Any]


def expand_sources(patterns: Iterable[Location | str]) -> tuple[list[str], list[str]]:
    """(sorted unique input files, patterns that matched nothing): see :func:`list_inputs`."""
    files, unmatched = list_inputs(patterns)
    return [f.location for f in files], unmatched


def list_inputs(patterns: Iterable[Location | str]) -> tuple[list[InputFile], list[str]]:
    """(input files sorted by location, unique; patterns that matched nothing).

    A pattern is a path, a glob (``**`` recurses, ``{fa,gb}`` lists alternatives), a
    directory (every file under it), or the same as an fsspec URL (``s3://b/x/**/*.fa.gz``),
    listed once with the sizes the listing reports; a :class:`Location` brings the
    storage options that reach it. Hidden files (``.name``) found by globs or directories
    are ignored (editor or temporary files)."""
    found: dict[str, InputFile] = {}
    unmatched: list[str] = []
    for pattern in map(as_location, patterns):
        alts = [pattern.at(alt) for alt in expand_braces(pattern.url)]
        hits = [h for alt in alts for h in alt.expand()]
        if hits:
            found.update((h.location, h) for h in hits)
        else:
            unmatched.append(pattern.url)
    return [found[k] for k in sorted(found)], unmatched


def expand_braces(pattern: str) -> list[str]:
    """``a.{fa,gb}`` -> ``[a.fa, a.gb]`` (nested and repeated groups too)."""
    depth, start = 0, -1
    for i, c in enumerate(pattern):
        if c == "{":
            if depth == 0:
                start = i
            depth += 1
        elif c == "}" and depth:
            depth -= 1
            if depth == 0:
                body, parts, level, last = pattern[start + 1 : i], [], 0, 0
                for j, ch in enumerate(body):
                    level += ch == "{"
                    level -= ch == "}"
                    if ch == "," and level == 0:
                        parts.append(body[last:j])
                        last = j + 1
                parts.append(body[last:])
                if len(parts) == 1:  # "{x}" is not a list of alternatives
                    continue
                head, tail = pattern[:start], pattern[i + 1 :]
                return [e for p in parts for e in expand_braces(head + p + tail)]
    return [pattern]


def _local_input(path: str) -> InputFile:
    st = os.stat(path)
    return InputFile(path, st.st_size, {"size": st.st_size, "mtime_ns": st.st_mtime_ns})


def _identity(info: Mapping[str, Any]) -> dict[str, Any]:
    ident: dict[str, Any] = {"size": int(info.get("size") or 0)}
    for key in ("ETag", "etag", "md5Hash", "crc32c", "LastModified", "mtime", "created"):
        if info.get(key) is not None:
            ident[key] = str(info[key])
    return ident
