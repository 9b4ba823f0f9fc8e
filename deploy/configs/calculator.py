"""The tool of the Qwen2.5 calculator recipe (calculator-qwen2.5-0.5b.toml): a stateless function, TRL's
``tools`` convention; its schema comes from the type hints and the docstring. Arithmetic only, read with
``ast`` (never ``eval``): a model's expression cannot run code."""

from __future__ import annotations

import ast
import operator

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.operand))
    raise ValueError("only numbers, + - * / // % and parentheses are allowed")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression, such as 48 / 2 + 48.

    Args:
        expression: numbers with + - * / // % and parentheses
    """
    result = _value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else str(result)
