"""experiments/sampler_vs_generate.py: rollcorr's hf:bf16 sampler and transformers' ``generate`` draw the same
tokens with the same log-probs given the same batches and seeds (the reading docs/engines.md gives)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments import sampler_vs_generate as svg  # noqa: E402


def test_the_sampler_and_generate_agree_draw_by_draw():
    result = svg.run(None, n=6, draws=1, batch_size=3, max_new_tokens=16)
    per = result["per_draw"]
    assert per["sampler"][0]["tokens"] > 0
    # transformers' DynamicCache path and generate run the same modules in the same order: bit for bit
    assert per["sampler_hfcache"] == per["generate"]
    # the static KV decoder runs the same arithmetic in its own attention: the same tokens, |Δp| to bf16 rounding
    # (relative 2^-8 per logit, far below this bound on a mean over the tokens)
    for fast, reference in ((per["sampler"][0], per["generate"][0]), (per["sampler_alone"][0], per["generate_alone"][0])):
        assert fast["tokens"] == reference["tokens"]
        assert abs(fast["mean_abs_dp"] - reference["mean_abs_dp"]) <= 2**-7 * reference["mean_abs_dp"]


def test_the_paragraph_reads_the_results_file(tmp_path):
    assert "Pending" in svg.paragraph(tmp_path)
    text = svg.paragraph()
    assert "draw the same tokens with the same log-probs in every draw" in text
