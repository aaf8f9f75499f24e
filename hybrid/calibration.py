"""Calibration text for static activation scales: a small built-in, varied corpus (prose, dialogue, lists,
numbers, code, a few languages), cut into token windows. Deterministic; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

TEXTS = [
    "The history of the bridge goes back to 1887, when the river was still crossed by ferry. Engineers argued for "
    "a decade about iron against stone before the council chose a steel arch with a span of 152 metres.",
    "User: Can you explain why the sky is blue?\nAssistant: Sunlight is scattered by the molecules of the air, and "
    "shorter wavelengths scatter much more strongly than longer ones, so blue light reaches us from every direction.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]",
    "Ingredients: 200 g flour, 2 eggs, 300 ml milk, a pinch of salt, 1 tablespoon of butter. Whisk the eggs and the "
    "milk, add the flour slowly, rest the batter for 30 minutes, then cook thin pancakes in a hot pan.",
    "Quarterly revenue rose 12.4% to $3.18 billion, while operating margin fell from 21% to 19.5% because of higher "
    "input costs. The board approved a dividend of $0.42 per share, payable on 15 March.",
    "La ville se réveille lentement : les boulangers ouvrent leurs portes, les cyclistes traversent le pont et le "
    "marché s'installe sur la place. Der Zug nach Berlin fährt um 7:45 Uhr von Gleis 3 ab.",
    "Theorem. For every prime p and integer a not divisible by p, a^(p-1) ≡ 1 (mod p). Proof sketch: the map "
    "x -> a*x permutes the nonzero residues, so the product of all of them is unchanged.",
    "SELECT customer_id, SUM(amount) AS total FROM orders WHERE created_at >= '2024-01-01' GROUP BY customer_id "
    "HAVING SUM(amount) > 1000 ORDER BY total DESC LIMIT 20;",
    "1. Check the power supply. 2. Restart the router. 3. If the light stays red, hold the reset button for ten "
    "seconds. 4. Call support with the serial number printed on the back of the device.",
    "She opened the old letter carefully. The ink had faded, but the words were still clear: meet me by the lighthouse "
    "when the tide is low, and bring the map your grandfather left you.",
    "<|im_start|>user\nSummarise the plot of Hamlet in two sentences.<|im_end|>\n<|im_start|>assistant\nPrince Hamlet "
    "seeks revenge on his uncle Claudius, who murdered Hamlet's father to take the throne. His hesitation leads to a "
    "chain of deaths that ends with the destruction of the royal family.",
    "The pass key is 48213. Remember it. 48213 is the pass key. The grass is green. The sky is blue. The sun is "
    "yellow. Here we go. There and back again.",
]


def read_calibration_file(path: str | Path) -> str:
    """The text of a calibration file (`hybrid quantize --calibration-file`), checked before any work.

    Raises:
        ValueError: the file is missing, a directory, unreadable, not UTF-8 text, or empty (only
            whitespace); the message names the file and what was expected.
    """
    where = f"--calibration-file {path}"
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{where}: no such file (expected a UTF-8 text file)")
    if p.is_dir():
        raise ValueError(f"{where}: is a directory (expected a UTF-8 text file)")
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise ValueError(f"{where}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    if not text.strip():
        raise ValueError(f"{where}: the file is empty (expected text to calibrate on)")
    return text


def calibration_batches(tokenizer, n_samples: int, length: int, texts: list[str] | None = None) -> list[torch.Tensor]:
    """`n_samples` windows of `length` token ids ([1, length] int64 each) cut from the texts, cycled as needed."""
    ids: list[int] = []
    for text in texts or TEXTS:
        ids.extend(tokenizer.encode(text + "\n\n"))
    if not ids:
        raise ValueError("the calibration text is empty")
    while len(ids) < n_samples * length:
        ids = ids + ids
    return [torch.tensor([ids[i * length:(i + 1) * length]]) for i in range(n_samples)]
