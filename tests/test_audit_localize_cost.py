"""--localize at real-model cost (issue 50 item 6): a component at layer i runs the learner from layer i's kept input
on, not the whole model again — the same numbers as the whole swapped forward, bit for bit, for fewer layers."""

import pytest
import torch

from rollcorr.audit.collect import builtin_prompts, collect
from rollcorr.audit.localize import (
    _layer_calls,
    components,
    localize,
    response_log_probs,
    start_layer,
    suffix_log_probs,
    swapped,
)
from rollcorr.engines import SamplingParams, make_learner, make_sampler


@pytest.fixture(scope="module")
def pair():
    learner, sampler = make_learner("hf:fp32"), make_sampler("hf:bf16")
    rollout = collect(sampler, learner, builtin_prompts(6), SamplingParams(max_new_tokens=10, seed=0), n=2, batch_size=12)
    part = rollout.select(list(range(8)))
    ids = torch.cat([part.prompt_ids, part.response_ids], 1)
    mask = torch.cat([part.prompt_mask.bool(), part.response_mask.bool()], 1)
    return learner, sampler, rollout, (ids, mask, part.prompt_ids.shape[1], part.response_ids)


def test_each_component_from_its_layer_equals_the_whole_swapped_forward(pair):
    """Every component swapped into the learner (a bf16 sampler: each one changes something): the log-probs from
    its first layer on (the prefix's hidden states kept from the reference forward) are the whole forward's."""
    learner, sampler, _, (ids, mask, p, targets) = pair
    model = learner.model
    with torch.no_grad():
        with _layer_calls(model) as calls:
            ref = response_log_probs(model, ids, mask, p, targets, 1.0)
        layers = model.config.num_hidden_layers
        assert len(calls) == layers + 1
        assert torch.equal(suffix_log_probs(model, calls, 0, p, targets, 1.0), ref)
        assert torch.equal(suffix_log_probs(model, calls, layers, p, targets, 1.0), ref)
        starts = {}
        for name, paths in components(model):
            starts[name] = start_layer(model, paths)
            if starts[name] is None:
                continue
            with swapped(model, sampler.model, paths):
                whole = response_log_probs(model, ids, mask, p, targets, 1.0)
                part = suffix_log_probs(model, calls, starts[name], p, targets, 1.0)
            assert not torch.equal(whole, ref), name  # the swap changes the log-probs …
            assert torch.equal(part, whole), name  # … and the suffix alone computes the same ones
    assert starts["embedding"] is None and starts["residual stream"] is None
    assert starts["final norm"] == starts["lm head"] == layers
    assert [starts[f"layer {i} {kind}"] for i in range(layers) for kind in ("attention", "mlp")] == \
        [i for i in range(layers) for _ in range(2)]


def _layer_calls_of(learner, sampler, rollout, **kw):
    """localize's result and how many times the learner's decoder layers ran in it."""
    count = [0]
    handles = [layer.register_forward_pre_hook(lambda *a: count.__setitem__(0, count[0] + 1))
               for layer in learner.model.get_decoder().layers]
    try:
        loc = localize(sampler, learner, rollout, responses=8, **kw)
    finally:
        for h in handles:
            h.remove()
    return loc, count[0]


def test_localize_exact_runs_each_decoder_layer_only_from_the_component_on(pair):
    """Decoder-layer calls of the learner in one --localize-exact: L (the reference forward) + 2·L (the embedding
    and the residual stream, whole) + Σ_i 2·(L − i) (each layer's attention and MLP from layer i on); the norm and
    the head run none. The whole-forward way was L·(2L + 5): on a 30-layer model 1,020 calls against 1,950."""
    learner, sampler, rollout, _ = pair
    layers = learner.model.config.num_hidden_layers
    loc, count = _layer_calls_of(learner, sampler, rollout, exact=True)
    assert count == layers + 2 * layers + sum(2 * (layers - i) for i in range(layers))
    assert count < layers * (2 * layers + 5)
    # in whole forwards, the components alone: L·(L + 3) layer calls now, L·(2L + 4) before — as the page says
    assert count - layers == layers * (layers + 3)
    from pathlib import Path

    page = " ".join((Path(__file__).resolve().parents[1] / "docs/audit.md").read_text(encoding="utf-8").split())
    assert "the components cost about L + 3 forwards instead of 2L + 4" in page
    assert loc["full_forward"]["k3"] > 0 and abs(sum(c["share"] for c in loc["components"]) - loc["share_sum"]) < 1


def test_the_default_runs_the_learner_once_and_the_measured_components_from_their_layer(pair):
    """The default: the learner's decoder layers run in its one reference forward (the estimate's backward runs none
    again) and in the exact measurement of the components it refines, each from its layer on — at most the
    largest estimate's run and REFINE forwards' worth beside it (at 30 layers at most 30 + 30 + 9 layer calls,
    against 1,020 for --localize-exact)."""
    from rollcorr.audit.localize import REFINE, head_cost, layers_run

    learner, sampler, rollout, _ = pair
    layers = learner.model.config.num_hidden_layers
    loc, count = _layer_calls_of(learner, sampler, rollout)
    paths = dict(components(learner.model))
    runs = [layers_run(learner.model, paths[name]) for name in loc["refined"]]  # decoder layers of each
    assert loc["refined"] and count == layers + sum(runs)
    assert sum(runs) <= layers + REFINE * (layers + head_cost(
        learner.model, rollout.response_ids.shape[1], rollout.prompt_ids.shape[1] + rollout.response_ids.shape[1]))
    assert count < layers + 2 * layers + sum(2 * (layers - i) for i in range(layers))  # the exact mode's


def _deep_localization(layers: int) -> dict:
    """A --localize result of the shape ``localize`` returns (the default's: the two largest shares measured, the
    rest estimated), for a model of ``layers`` layers."""
    sites = [{"layer": i, "site": site, "rel_error": 1e-3 * (1 + i)} for i in range(layers)
             for site in ("input", "attention", "mlp")] + [{"layer": None, "site": "final norm", "rel_error": 0.05},
                                                          {"layer": None, "site": "logits", "rel_error": 0.06}]
    names = ["embedding", *(f"layer {i} {k}" for i in range(layers) for k in ("attention", "mlp")), "final norm",
             "lm head", "residual stream"]
    shares = torch.rand(len(names), generator=torch.Generator().manual_seed(0)).tolist()
    measured = sorted(shares)[-2:]
    return {"sites": sites, "components": [{"component": n, "share": v / sum(shares),
                                            "method": "exact" if v in measured else "estimate"}
                                           for n, v in zip(names, shares)]}


@pytest.mark.parametrize("layers", [4, 30, 64])
def test_the_localization_figure_reads_at_any_depth(layers):
    """Issue 50: at 30 layers the figure had 94 overprinted x-ticks and 5-point bar labels. Now: a layer axis
    with at most 13 ticks, tick labels that do not overlap, names at 8 points, everything inside the figure."""
    from rollcorr.audit.plots import localization_figure

    fig = localization_figure(_deep_localization(layers))
    renderer = fig.canvas.get_renderer()
    left, middle, right = fig.axes[:3]
    for ax in (left, middle):
        ticks = [t for t in ax.get_xticklabels() if t.get_text() and ax.get_xlim()[0] <= t.get_position()[0] <= ax.get_xlim()[1]]
        assert 2 <= len(ticks) <= 13
        boxes = sorted((t.get_window_extent(renderer) for t in ticks), key=lambda b: b.x0)
        assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:]))  # no two tick labels overlap
        assert ax.get_xlim()[1] >= layers - 1
    names = right.get_yticklabels()
    assert len(names) == 10 and all(t.get_fontsize() >= 8 for t in names)
    assert sum(t.get_text().endswith(" (est.)") for t in names) == 8  # the two measured are not marked
    assert "hatched: first-order estimate" in middle.get_title()
    figure = fig.bbox
    assert [t.get_text() for t in left.get_legend().get_texts()][-2:] == ["final norm", "logits"]
    for text in [*names, *(ax.title for ax in fig.axes[:3])]:
        box = text.get_window_extent(renderer)
        assert figure.x0 <= box.x0 and box.x1 <= figure.x1, text.get_text()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_a_mixture_of_experts_from_its_layer_equals_the_whole_forward(family):
    """The same on transformers' MoE families (a router is a component too): from its layer on, bit for bit."""
    import copy

    from test_moe import FAMILIES, tiny_moe  # tests/ is on sys.path (pytest rootdir)

    learner = tiny_moe(family.removesuffix("_raw"), **FAMILIES[family])
    sampler = copy.deepcopy(learner).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ids, p = torch.randint(3, 40, (3, 9), generator=g), 4
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :2] = False  # a left-padded prompt
    targets = ids[:, p:]
    names = [name for name, _ in components(learner)]
    assert any(name.endswith("router") for name in names)
    with torch.no_grad():
        with _layer_calls(learner) as calls:
            response_log_probs(learner, ids, mask, p, targets, 1.0)
        for name, paths in components(learner):
            start = start_layer(learner, paths)
            if start is None:
                continue
            with swapped(learner, sampler, paths):
                whole = response_log_probs(learner, ids, mask, p, targets, 1.0)
                assert torch.equal(suffix_log_probs(learner, calls, start, p, targets, 1.0), whole), name


def test_the_audit_page_reads_the_committed_benchmark():
    """docs/audit.md's sentence on the cost is benchmarks/results/bench_localize.txt's (a generated header: machine,
    load before and after, the command), on a 30-layer model: the default's seconds and ratios (wall, CPU) to the
    audit's sampling and scoring, `rollcorr audit --localize` against the plain audit end to end, the exact mode's
    seconds, the largest estimate against its measurement, and whether the two modes named the same component
    first."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    lines = (root / "benchmarks/results/bench_localize.txt").read_text().splitlines()
    assert lines[0].startswith("# bench_localize: ") and "load before" in lines[0] and "command: " in lines[1]
    assert lines[-1].startswith("# load after ") and "(30 layers)" in lines[1]
    assert "-n 8 --max-new-tokens 32" in lines[1] and "--cli" in lines[1]
    rows = {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in (line.split("|") for line in lines if "|" in line)}
    audit = [float(x) for x in rows["audit: sampling and scoring (mean of the runs before and after the default)"]]
    fast = [float(x) for x in rows["localize (default: first-order estimate, largest measured)"]]
    exact = [float(x) for x in rows["localize --localize-exact (prefix reused)"]]
    plain = [float(x) for x in rows["rollcorr audit (mean of the runs before and after)"]]
    cli = [float(x) for x in rows["rollcorr audit --localize"]]
    for row, base in ((fast, audit), (exact, audit), (cli, plain)):  # the ratios are the table's own seconds'
        for sec, ratio in ((0, 1), (2, 3)):  # within the printing's rounding: seconds ± 0.05, a ratio ± 0.005
            a, b = row[sec], base[sec]
            assert abs(row[ratio] - a / b) <= 0.005 + 0.05 * (1 / b + a / b**2), (row, base)
    assert exact[0] > fast[0] and exact[2] > fast[2]  # the default is the faster
    same = rows["top component"][2] == "same: True"
    first = next(line for line in lines if line.startswith("measured by the default | "))
    name, measured = first.split("|")[1].strip().split(": ", 1)
    share, estimate = measured.removesuffix(" %)").split(" % (estimate ")
    exact_share = first.split("|")[2].strip().removeprefix("exact run: ")
    page = " ".join((root / "docs/audit.md").read_text(encoding="utf-8").split())
    sentence = (f"on SmolLM2's 30 layers (8 responses of 32 tokens) the default took {fast[0]:.1f} s against "
                f"{audit[0]:.1f} s for the audit's sampling and scoring: {fast[1]:.2f}× in wall time, {fast[3]:.2f}× "
                f"in CPU time; `rollcorr audit --localize` took {cli[0]:.0f} s end to end against {plain[0]:.0f} s "
                f"for the plain audit ({cli[1]:.2f}× wall, {cli[3]:.2f}× CPU); --localize-exact took {exact[0]:.0f} s "
                f"({exact[1]:.1f}× the sampling and scoring). The default measured its largest estimate, the {name}: "
                f"{share} % of the k3, estimated at {estimate} % (--localize-exact: {exact_share}); the two modes "
                f"named {'the same' if same else 'a different'} component first.")
    assert sentence in page, sentence
