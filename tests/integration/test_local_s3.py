"""The local pool's S3 tier refuses to start on a disk with no room for a volume.

``weed mini`` sizes its volumes from the disk's free space and keeps part of the disk free;
on a nearly full disk it answered S3 with room for no volume, and every upload then failed
("no volume server capacity registered"): a pool ran with a tier that stored nothing, and its
servers could not hand agents over. Seen in CI with 1.2 GB free on a 252 GB disk.
"""
from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.errors import ConfigError
from app.pool.seaweed import LocalS3
from support.servers import free_ports


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 MiB tmpfs filled to 4 MiB free: less than the 1% ``weed mini`` keeps free (it
    holds seven volumes empty, one with 24 MiB free)."""
    root = tmp_path / "small"
    root.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(root)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root: {mounted.stderr.strip()}")
    try:
        subprocess.run(["fallocate", "-l", "508M", str(root / "full")], check=True)
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=True)


def test_a_local_s3_with_no_room_for_a_volume_is_refused_naming_the_disk(small_disk: Path, tmp_path: Path) -> None:
    s3 = LocalS3(small_disk / "s3", free_ports(LocalS3.N_PORTS))
    with pytest.raises(ConfigError, match=r"no room for a volume in .*small/s3: 4 MiB free of 512 MiB"):
        s3.start(tmp_path / "s3.log")
    assert not [line for line in subprocess.run(["pgrep", "-af", "weed mini"], capture_output=True,
                                                text=True).stdout.splitlines() if str(small_disk) in line]
