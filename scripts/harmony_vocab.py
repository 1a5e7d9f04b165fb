"""Put OpenAI's o200k_base vocabulary where openai-harmony reads it, for the tests that check gpt-oss's format.

    python scripts/harmony_vocab.py DIR     # writes DIR/o200k_base.tiktoken (TIKTOKEN_ENCODINGS_BASE=DIR)

openai-harmony downloads the file from openaipublic.blob.core.windows.net at its first use; machines with only a
package registry (this project's test machines, CI) cannot. litellm's wheel ships the same file for offline use, in
tiktoken's cache layout (named by the SHA-1 of its URL), so it is taken from there: the wheel alone (--no-deps, 44 MB),
one member, checked against the SHA-256 openai-harmony itself checks. Written by hand: no package installs the
vocabulary as a file of its own. Nothing is written when the registry or the hash says no (a line says why).
"""
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "o200k_base.tiktoken"
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # openai-harmony's expected hash
WHEEL = "litellm==1.110.2"
MEMBER = "litellm/litellm_core_utils/tokenizers/fb374d419588a4632f3f557e76b4b70aebbca790"  # tiktoken's cache name


def main(folder: str) -> int:
    target = Path(folder) / NAME
    if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == SHA256:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL],
                             capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if got.returncode or not wheels:
            print(f"note: {NAME} not fetched ({WHEEL} not downloadable: {got.stderr.strip()[-200:]}); "
                  f"the openai-harmony test needs it", file=sys.stderr)
            return 1
        with zipfile.ZipFile(wheels[0]) as wheel:
            data = wheel.read(MEMBER)
    if hashlib.sha256(data).hexdigest() != SHA256:
        print(f"note: {NAME} from {WHEEL} does not have openai-harmony's SHA-256; not written", file=sys.stderr)
        return 1
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(target)
    print(f"{NAME} ({len(data):,} bytes) written to {target.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
