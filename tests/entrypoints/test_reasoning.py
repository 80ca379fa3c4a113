"""Reasoning split from the answer (entrypoints/openai/reasoning.py): whole answers and the same
answers streamed in pieces cut at every awkward place (inside a tag, between its characters),
an unterminated <think>, and a prompt that leaves <think> open (DeepSeek-R1's template)."""

from __future__ import annotations

import pytest

from specpipe.entrypoints.openai.reasoning import ReasoningSplitter, prompt_opens_thinking, split_reasoning

# (answer as the model wrote it, prompt leaves <think> open, expected reasoning, expected content)
RECORDED = [
    ("<think>\nThe user greets me.\n</think>\n\nHello!", False, "\nThe user greets me.\n", "Hello!"),  # Qwen3
    ("<think>\n\n</think>\n\nHello!", False, "\n\n", "Hello!"),  # Qwen3, enable_thinking false in the output
    ("Okay, 2 + 2 is 4.\n</think>\n\nThe answer is 4.", True, "Okay, 2 + 2 is 4.\n", "The answer is 4."),  # R1
    ("<think>I should count: 1, 2, 3", False, "I should count: 1, 2, 3", ""),  # cut off by max_tokens
    ("Hello! a <think> b", False, None, "Hello! a <think> b"),  # not at the start: content
    ("", False, None, ""),
    ("  plain answer", False, None, "  plain answer"),
    ("<thin", False, None, "<thin"),  # a tag never finished is content
    ("<think>a < b </thin but not closed", False, "a < b </thin but not closed", ""),
]


@pytest.mark.parametrize("text,open_,reasoning,content", RECORDED)
def test_whole_answers(text, open_, reasoning, content):
    assert split_reasoning(text, open_) == (reasoning, content)


@pytest.mark.parametrize("text,open_,reasoning,content", RECORDED)
def test_streamed_in_pieces_cut_anywhere(text, open_, reasoning, content):
    """Every way of cutting the text in two, and one character at a time: the pieces join to
    the whole answer's split, and nothing comes out of order."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        s = ReasoningSplitter(open_)
        got_r, got_c = "", ""
        for i, piece in enumerate(pieces):
            r, c = s.feed(piece, final=i == len(pieces) - 1)
            assert not (got_c and r), f"reasoning after content for {pieces}"
            got_r, got_c = got_r + r, got_c + c
        if not pieces:
            s.feed("", final=True)
        assert (s.reasoning_text, got_c) == (reasoning, content), pieces
        assert got_r == (reasoning or "")


def test_a_tag_split_across_pieces_is_held_not_sent():
    s = ReasoningSplitter()
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>abc</th") == ("abc", "")
    assert s.feed("ink>\n") == ("", "")
    assert s.feed("\nDone") == ("", "Done")


def test_which_prompts_leave_thinking_open():
    assert prompt_opens_thinking("<｜Assistant｜><think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
