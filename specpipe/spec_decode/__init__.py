"""Speculation: the dynamic token tree (tree.py), draft sources and verification."""

from specpipe.spec_decode.tree import Node, TokenTree, VerifyResult

__all__ = ["Node", "TokenTree", "VerifyResult"]
