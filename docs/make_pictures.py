"""Regenerate the README's pictures from the sample plans.

Run: ``.venv/bin/python docs/make_pictures.py``. Writes ``docs/animation.png`` (the last
frame of the 8-GPU animation), ``docs/animation.gif`` (the whole animation, 10 fps, 640 px
wide) and ``docs/dashboard.png`` (via ``dashboard.screenshot``).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import av
from PIL import Image

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
PLAN = ROOT / "sample_plans" / "mixed8_g1n2+g2n1+g4n1.json"


def decode_frames(video: Path) -> list[Image.Image]:
    with av.open(str(video)) as container:
        return [frame.to_image() for frame in container.decode(video=0)]


def main() -> None:
    knapformer = Path(sys.executable).parent / "knapformer"
    with tempfile.TemporaryDirectory() as tmp:
        video = Path(tmp) / "routing.mp4"
        subprocess.run(
            [str(knapformer), "animate", str(PLAN), "-o", str(video), "--quality", "medium"],
            check=True,
        )
        frames = decode_frames(video)
    frames[-1].save(DOCS / "animation.png")
    step = max(1, round(30 / 10))  # 30 fps medium quality -> 10 fps GIF
    small = [
        f.resize((640, round(640 * f.height / f.width))).quantize(colors=128)
        for f in frames[::step]
    ]
    small[0].save(
        DOCS / "animation.gif",
        save_all=True,
        append_images=small[1:] + [small[-1]] * 20,  # hold the last frame ~2 s
        duration=100,
        loop=0,
        optimize=True,
    )
    subprocess.run([sys.executable, "-m", "dashboard.screenshot"], check=True, cwd=ROOT)
    print(f"wrote {DOCS / 'animation.png'}, {DOCS / 'animation.gif'}, {DOCS / 'dashboard.png'}")


if __name__ == "__main__":
    main()
