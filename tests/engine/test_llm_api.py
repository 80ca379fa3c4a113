"""The Python API end to end, run as a user would: scripts in a subprocess, stage processes and all."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from specpipe import LLM, SamplingParams
from specpipe.config import EngineConfig
from specpipe.engine.engine import Engine


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama", num_hidden_layers=4))


def run_script(tmp_path, body: str, timeout: float = 240) -> subprocess.CompletedProcess:
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout)


# Pasted into the scripts below: the stage processes are this process's children.
CHILDREN = """
import os
def children():
    me = str(os.getpid())
    out = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out += fields[1] == me and fields[0] != "Z"
    return out
"""

PROMPTS = ["hello there", "the cat sat on the mat, the cat sat", "a b c a b c a b"]


def test_generate_and_chat_across_stage_processes(model, tmp_path):
    run = run_script(tmp_path, CHILDREN + textwrap.dedent(f"""
        import json
        from specpipe import LLM, SamplingParams

        if __name__ == "__main__":
            params = [SamplingParams(max_tokens=12), SamplingParams(temperature=0.8, seed=3, max_tokens=9),
                      SamplingParams(max_tokens=12, stop=["zz"])]
            with LLM(model={model!r}, stages=2, mode="specpipe-db", draft="ngram", tree_width=4,
                     kv_memory="8MiB", max_context=128) as llm:
                outs = llm.generate({PROMPTS!r}, params, use_tqdm=False)
                chat = llm.chat([{{"role": "user", "content": "hi"}}], SamplingParams(max_tokens=5))
                alive = children()
            print(json.dumps({{"outs": [[o.text, o.token_ids, o.finish_reason, o.stats["tokens_per_step"]]
                                        for o in outs],
                              "chat": chat[0].token_ids, "alive_inside": alive,
                              "alive_after": children()}}))
    """))
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["alive_inside"] == 2 and got["alive_after"] == 0  # the context manager ended the stages
    # The same prompts alone, in pp, in this process: the same tokens.
    engine = Engine(EngineConfig(model=model, mode="pp", transport="inproc", kv_memory="8MiB", max_context=128))
    try:
        params = [SamplingParams(max_tokens=12), SamplingParams(temperature=0.8, seed=3, max_tokens=9),
                  SamplingParams(max_tokens=12, stop=["zz"])]
        for (text, ids, reason, tps), prompt, p in zip(got["outs"], PROMPTS, params):
            alone = engine.generate(prompt, p, chat=False)
            assert (ids, text, reason) == (alone.token_ids, alone.text, alone.finish_reason)
            assert tps > 0
        chat = engine.generate(engine.prompts.encode_chat([{"role": "user", "content": "hi"}]), SamplingParams(max_tokens=5))
        assert got["chat"] == chat.token_ids
    finally:
        engine.close()


def test_stage_processes_end_when_the_llm_is_garbage_collected(model, tmp_path):
    run = run_script(tmp_path, CHILDREN + textwrap.dedent(f"""
        import gc, time
        from specpipe import LLM

        def main():
            llm = LLM(model={model!r}, stages=2, kv_memory="8MiB", max_context=64)
            before = children()
            del llm
            gc.collect()
            deadline = time.time() + 20
            while children() and time.time() < deadline:
                time.sleep(0.1)
            print(before, children())

        if __name__ == "__main__":
            main()
    """))
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-2:] == ["2", "0"]


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_a_script_without_main_guard_or_on_stdin_just_works(model, tmp_path, how):
    """Stages are programs of their own: nothing re-imports the user's script, so neither a
    missing `if __name__ == "__main__":` nor `python - <<EOF` (no file to re-import) matters."""
    body = textwrap.dedent(f"""
        from specpipe import LLM, SamplingParams

        llm = LLM(model={model!r}, stages=2, kv_memory="8MiB", max_context=64)
        print(llm.generate("hello", SamplingParams(max_tokens=5), use_tqdm=False)[0].token_ids)
        llm.close()
    """)
    if how == "file":
        run = run_script(tmp_path, body)
    else:
        run = subprocess.run([sys.executable, "-"], input=body, capture_output=True, text=True, timeout=240,
                             cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr and "failed to start" not in run.stderr
    assert len(json.loads(run.stdout.strip().splitlines()[-1])) == 5


def test_in_process_api_and_bad_input(model):
    with LLM(model=model, mode="pp-cb", kv_memory="8MiB", max_context=64, max_num_seqs=4, max_step_rows=8) as llm:
        one = llm.generate("hello", SamplingParams(max_tokens=4), use_tqdm=False)
        assert len(one) == 1 and len(one[0].token_ids) == 4 and one[0].outputs[0].text == one[0].text
        assert one[0].finish_reason == "length" and one[0].prompt == "hello"
        many = llm.generate([[5, 6, 7]] * 6, SamplingParams(max_tokens=3), use_tqdm=False)
        assert [o.token_ids for o in many] == [many[0].token_ids] * 6  # six requests, four at a time
        with pytest.raises(ValueError, match="one per prompt"):
            llm.generate(["a", "b"], [SamplingParams()] * 3)
        with pytest.raises(ValueError, match="context"):
            llm.generate("x" * 200, SamplingParams(max_tokens=4))


def test_closing_stops_the_grammar_compilers_child(model):
    """Structured output compiles in a child process (grammar/sandbox.py); closing the LLM ends
    it, as `specpipe serve` does on shutdown (an LLM or Engine left it running until exit)."""
    from specpipe.sampling import StructuredOutput

    with LLM(model=model, mode="pp-cb", kv_memory="8MiB", max_context=64) as llm:
        out = llm.generate("a person", SamplingParams(max_tokens=6, structured=StructuredOutput(json_object=True)),
                           use_tqdm=False)
        assert out[0].token_ids
        child = llm.engine.prompts.grammars._sandbox._proc
        assert child is not None and child.poll() is None
    assert child.poll() is not None
