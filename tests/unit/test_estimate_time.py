"""``ulysses-mm estimate --time`` and ``--best``: the step's FLOPs are ``train_flops`` of the
built model on a real batch, the time grows with the documents' attention pairs, the
all-to-all bytes are :mod:`ulysses_mm.tools.estimate.comm`'s, the fastest layout fits and
is no slower than any other that fits, bad flags are one-line refusals, and the shipped
Llama 3.1 config prints its prediction. Arithmetic and one tiny model: seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ulysses_mm import cli
from ulysses_mm.config import RunConfig, load_config
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.tools.estimate import EstimateOptions, estimate
from ulysses_mm.tools.estimate.devices import EFFICIENCY, GPU_KINDS
from ulysses_mm.tools.estimate.documents import DocLengths, doc_lengths
from ulysses_mm.tools.estimate.fastest import layouts, rank_layouts
from ulysses_mm.tools.estimate.step_time import flop_rates, step_time

REPO = Path(__file__).resolve().parents[2]
SPACE = TokenSpace.from_vocab({"dna": 10, "audio": 256})


def _cfg(*overrides: str) -> RunConfig:
    return load_config(
        RunConfig,
        REPO / "configs" / "debug-tiny.yaml",
        ["model.num_attention_heads=8", "model.head_dim=16", *overrides],
    )


def _time(cfg: RunConfig, seq_len: int, docs: DocLengths, gpus: int = 4, sp: int = 2):
    est = estimate(cfg, seq_len, EstimateOptions(gpus=gpus, sp=sp, space=SPACE))
    st = step_time(cfg, est, flop_rates(cfg, SPACE), docs, GPU_KINDS["h100"], EFFICIENCY)
    return est, st


def test_the_flop_count_is_train_flops_of_the_built_model_on_a_real_batch():
    from ulysses_mm.loader.synthetic import single_modality_batch
    from ulysses_mm.model.llama import build_model
    from ulysses_mm.train.flops import causal_pairs, train_flops

    cfg = _cfg("data.micro_batch_size=2")
    seq_len, doc_len = 4096, 1000
    model = build_model(cfg.model, SPACE)
    batch = single_modality_batch(SPACE, 2, seq_len, doc_len)
    pairs = causal_pairs(batch.doc_ids)
    targets = int((batch.labels != -100).sum())
    widest = max(SPACE.modalities, key=lambda m: SPACE.range(m).size)
    real = train_flops(model, batch.input_ids.numel(), pairs, {widest: targets})

    docs = doc_lengths(str(doc_len))
    assert docs.pairs_per_sample(seq_len) * 2 == pairs
    rates = flop_rates(cfg, SPACE)
    assert rates.head == widest
    ours = rates.per_token * 2 * seq_len + rates.per_pair * pairs + rates.per_target * targets
    assert ours == pytest.approx(real, rel=1e-12)
    # the step's own count takes every token as a target: within the documents' ends
    _, st = _time(cfg, seq_len, docs, gpus=1, sp=1)
    assert st.model_flops == pytest.approx(real, rel=0.01)


def test_time_grows_with_the_attention_pairs():
    cfg = _cfg()
    n = 1 << 16
    specs = ["512", "lognormal:2048:1", "8192", "full"]
    pairs, steps = [], []
    for spec in specs:
        _, st = _time(cfg, n, doc_lengths(spec), gpus=2)  # dp 1: no rank waits for another
        pairs.append(st.pairs_per_sample)
        steps.append(st.step_s)
    assert pairs == sorted(pairs) and steps == sorted(steps)
    assert steps[-1] > 2 * steps[0]
    assert pairs[-1] == n * (n + 1) / 2
    with pytest.raises(Exception, match="lognormal:MEDIAN"):
        doc_lengths("lognormal:0")


def test_the_slowest_dp_rank_is_counted_and_balancing_shortens_it():
    """Unequal documents at dp 4 with 4 micro-steps a step: the compute is the slowest
    rank's, less of it balanced; samples of one document each are equal."""
    docs = doc_lengths("lognormal:4096:2")
    n, ga = 1 << 15, "deepspeed.gradient_accumulation_steps=4"
    _, on = _time(_cfg(ga), n, docs, gpus=8, sp=2)
    _, off = _time(_cfg(ga, "data.balance=false"), n, docs, gpus=8, sp=2)
    imb = on.dp_imbalance
    assert 1.0 < imb["balanced"] < imb["in_order"] and imb["counted"] == imb["balanced"]
    assert off.dp_imbalance["counted"] == imb["in_order"]
    assert on.step_s < off.step_s
    assert on.seconds["attention"] / off.seconds["attention"] == pytest.approx(
        imb["balanced"] / imb["in_order"]
    )
    assert any("balanced (data.balance on; counted)" in note for note in on.notes)
    _, full = _time(_cfg(ga), n, doc_lengths("full"), gpus=8, sp=2)
    assert full.dp_imbalance["counted"] == 1.0 and not full.notes


def test_all_to_all_bytes_are_comms_and_checkpointing_sends_the_forward_again():
    cfg = _cfg()
    est, st = _time(cfg, 8192, doc_lengths("full"))
    sent, layers = est.sent_per_layer, est.shape.layers
    assert st.comm_bytes["all_to_all"] == layers * (
        sent["all_to_all_forward"] + sent["all_to_all_backward"]
    )
    est_ac, st_ac = _time(_cfg("model.activation_checkpointing=true"), 8192, doc_lengths("full"))
    assert est_ac.sent_per_layer == sent
    assert st_ac.comm_bytes["all_to_all"] == layers * (
        2 * sent["all_to_all_forward"] + sent["all_to_all_backward"]
    )
    assert st_ac.executed_flops["dense"] == pytest.approx(st.executed_flops["dense"] * 4 / 3)
    # a Ulysses group spanning nodes goes over the network: slower
    _, near = _time(cfg, 8192, doc_lengths("full"), gpus=8, sp=8)
    est_far = estimate(cfg, 8192, EstimateOptions(gpus=8, sp=8, space=SPACE, gpus_per_node=4))
    far = step_time(
        cfg, est_far, flop_rates(cfg, SPACE), doc_lengths("full"), GPU_KINDS["h100"], EFFICIENCY
    )
    assert far.exposed["all-to-all"] > 2 * near.exposed["all-to-all"]


def test_best_is_a_layout_that_fits_and_no_slower_than_any_other_that_fits():
    cfg = _cfg("model.activation_checkpointing=true")
    n = 1 << 15
    opts = EstimateOptions(gpus=8, space=SPACE, gpu_mem_gib=2.4)
    ranked = rank_layouts(
        cfg, n, opts, flop_rates(cfg, SPACE), doc_lengths("full"), GPU_KINDS["h100"], EFFICIENCY
    )
    assert len(ranked) == len(layouts(cfg, 8, n))
    fitting = [c for c in ranked if c.fits]
    assert fitting and len(fitting) < len(ranked)  # the budget rules some out
    best = ranked[0]
    assert best.fits and best.est.total <= 2.4 * (1 << 30)
    assert all(best.time.tokens_per_s >= c.time.tokens_per_s for c in fitting)
    # every layout tried is one the layout checks accept
    for c in ranked:
        lay = c.est.step.layout
        assert lay.world_size == 8 and 8 % lay.sp == 0


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["estimate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--gpu-kind", "v100"], "--gpu-kind"),
        (["--tokens", "0"], "--tokens"),
        (["--doc-lengths", "many"], "--doc-lengths"),
        (["--doc-lengths", "manifest"], "--manifest"),
    ],
)
def test_bad_flag_values_are_one_line_refusals(capsys, flags, says):
    with pytest.raises(SystemExit) as e:
        rc, _, err = _cli(capsys, "debug-tiny", "--seq-len", "4096", "--time", *flags)
        raise SystemExit(rc)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip() or err
    lines = [line for line in err.splitlines() if line.strip()]
    assert says in lines[-1]
    assert "Traceback" not in err


def test_cli_time_json_and_best(capsys):
    rc, out, _ = _cli(capsys, "debug-tiny", "--seq-len", "8192", "--time", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["time"]["step_s"] > 0 and 0 < doc["time"]["mfu"] < 1
    assert doc["time"]["budget_s"] == pytest.approx(1e9 / doc["time"]["tokens_per_s"])
    rc, out, _ = _cli(capsys, "debug-tiny", "--seq-len", "8192", "--gpus", "4", "--best")
    assert rc == 0 and "fastest layouts of 4 × H100" in out and "  1. " in out


def test_llama31_8b_1m_on_8_h100(capsys):
    rc, out, _ = _cli(capsys, "llama3.1-8b-1m", "--gpus", "8", "--time")
    assert rc == 0
    assert "time on 8 × H100 SXM 80GB" in out
    stage3 = next(line for line in out.splitlines() if line.strip().startswith("stage 3 "))
    assert "tokens/s" in stage3 and "MFU" in stage3
    assert "the whole run:" in out and "efficiencies assumed" in out
    # one 1M-token step, every sample one document: minutes, attention-bound
    last = load_config(
        RunConfig,
        REPO / "configs" / "llama3.1-8b-1m.yaml",
        ["train.stages=[]", "data.seq_len=1048576", "data.micro_batch_size=1"],
    )
    space = TokenSpace.from_vocab(last.model.modalities)
    est = estimate(last, 1 << 20, EstimateOptions(gpus=8, space=space))
    st = step_time(
        last, est, flop_rates(last, space), doc_lengths("full"), GPU_KINDS["h100"], EFFICIENCY
    )
    assert 120 < st.step_s < 1200
    assert st.exposed["attention"] > 0.8 * st.step_s


def test_element_wise_work_is_timed_from_a_measured_row_or_moved_over_hbm():
    from dataclasses import replace

    cfg, n = _cfg(), 1 << 14
    est = estimate(cfg, n, EstimateOptions(gpus=2, sp=2, space=SPACE))
    rates, docs, h100 = flop_rates(cfg, SPACE), doc_lengths("full"), GPU_KINDS["h100"]
    sh, tokens = est.shape, n * cfg.data.micro_batch_size / 2  # a rank's tokens
    datasheet = step_time(cfg, est, rates, docs, h100, EFFICIENCY)
    touched = 10 * sh.hidden + 2 * (sh.q_width + sh.kv_width) + 3 * sh.inter
    hbm = h100.hbm_bytes_s * EFFICIENCY.memory
    want = tokens * (sh.layers * 3 * touched * 4 + sh.widest_head * 16 * 4 / 3) / hbm
    assert datasheet.exposed["element-wise"] == pytest.approx(want, rel=1e-9)  # fp32 here
    timed = replace(h100, token_layer_s=1e-6, target_vocab_s=1e-9)
    st = step_time(cfg, est, rates, docs, timed, EFFICIENCY)
    want = tokens * (sh.layers * 1e-6 + sh.widest_head * 1e-9 * 4 / 3)
    assert st.exposed["element-wise"] == pytest.approx(want, rel=1e-9)
    assert st.step_s - datasheet.step_s == pytest.approx(
        st.exposed["element-wise"] - datasheet.exposed["element-wise"], rel=1e-6
    )
