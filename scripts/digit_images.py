"""Write one PNG per digit from the test split of the digits data set (docs/images/*.png).

The images are the 8x8 test images exactly as the training module sees them (8-bit grayscale,
ink bright), so a served digits archive classifies them as it classified its test split:

    python scripts/digit_images.py docs/images
    curl -T docs/images/seven.png http://127.0.0.1:8080/predictions/digits
"""

from __future__ import annotations

import sys
from pathlib import Path

from PIL import Image

from scriptserve.training.data import load_splits

NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def main(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    test = load_splits(seed=0).test
    labels = test.labels.tolist()
    for digit, name in enumerate(NAMES):
        image = test.raw[labels.index(digit)]  # the first test image of that digit
        path = folder / f"{name}.png"
        Image.fromarray(image, mode="L").save(path, optimize=True)
        print(path)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images"))
