"""A manifest body over the cap (``data.max_manifest_bytes``) is refused in one line naming
the location, the size and the cap, before it is read whole: a local file by its size, an
http URL by its Content-Length, and a body of unknown size by reading no further than the
cap."""

from __future__ import annotations

import http.server
import threading

import pytest
from conftest import serve_dir

from ulysses_mm.config.schema import DataConfig
from ulysses_mm.core.errors import ConfigError, DataError
from ulysses_mm.core.storage import Location
from ulysses_mm.shards.manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError

MiB = 1 << 20
CAP = 1 * MiB
BIG = 64 * MiB


@pytest.fixture
def big_dir(tmp_path):
    with open(tmp_path / "manifest.json", "wb") as f:
        f.truncate(BIG)  # sparse: no disk, and never read here
    (tmp_path / "small.json").write_bytes(b"x" * 100)
    return tmp_path


class _Quiet(http.server.SimpleHTTPRequestHandler):
    sent = 0
    lock = threading.Lock()

    def log_message(self, *args):  # keep the test output clean
        pass

    def copyfile(self, source, outputfile):
        try:
            while chunk := source.read(64 * 1024):
                outputfile.write(chunk)
                with self.lock:
                    type(self).sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass


class _NoLength(_Quiet):
    """Sends no Content-Length: the body's size is known only at its end."""

    def send_header(self, keyword, value):
        if keyword.lower() != "content-length":
            super().send_header(keyword, value)


def test_a_local_manifest_over_the_cap_is_one_line(big_dir):
    where = str(big_dir / "manifest.json")
    with pytest.raises(DataError) as e:
        Manifest.load(str(big_dir), max_bytes=CAP)
    msg = str(e.value)
    assert isinstance(e.value, ManifestError) and "\n" not in msg
    assert where in msg and f"{BIG} bytes" in msg and f"cap of {CAP} bytes" in msg
    assert "data.max_manifest_bytes" in msg
    # under the cap it is read (and here refused as JSON, as before)
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.load(str(big_dir / "small.json"), max_bytes=CAP)


def test_an_http_manifest_over_the_cap_is_refused_by_its_length(big_dir):
    _Quiet.sent = 0
    with serve_dir(big_dir, _Quiet) as url, pytest.raises(ManifestError) as e:
        Manifest.load(Location(url, timeouts=(5.0, 10.0)), max_bytes=CAP)
    msg = str(e.value)
    assert f"{url}/manifest.json" in msg and f"{BIG} bytes" in msg and str(CAP) in msg
    assert "\n" not in msg and _Quiet.sent < BIG // 4  # the body was not fetched


def test_a_body_of_unknown_size_is_read_no_further_than_the_cap(big_dir):
    _NoLength.sent = 0
    with serve_dir(big_dir, _NoLength) as url:
        with pytest.raises(ManifestError) as e:
            Manifest.load(Location(url, timeouts=(5.0, 10.0)), max_bytes=CAP)
        msg = str(e.value)
        assert f"{url}/manifest.json" in msg and f"more than {CAP} bytes" in msg
        assert "\n" not in msg and _NoLength.sent < BIG // 2
        data = Location(f"{url}/small.json", timeouts=(5.0, 10.0)).read_bytes_capped(CAP)
        assert data == b"x" * 100


def test_the_cap_is_a_data_setting():
    assert DataConfig().max_manifest_bytes == MAX_MANIFEST_BYTES
    with pytest.raises(ConfigError, match=r"data.max_manifest_bytes must be >= 1"):
        DataConfig(max_manifest_bytes=0)
