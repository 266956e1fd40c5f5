"""The calculator tool: exact arithmetic through `ast` (never eval), with bounds on size and time."""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any

from actors.tools.registry import ERROR, Tool


class Calculator(Tool):
    """Exact arithmetic: + - * / // % ** and parentheses on integers and decimals (as fractions, so
    0.1 + 0.2 is 0.3). Results print as integers, exact decimals, or decimals rounded to `places`."""

    name = "calculator"
    tag = "calc"
    description = "Evaluate an arithmetic expression exactly, e.g. (2 + 3) * 4 / 5 or 2 ** 10."
    parameters = {"type": "object", "properties": {"expression": {"type": "string", "description": "the expression"}},
                  "required": ["expression"], "additionalProperties": False}

    def __init__(self, max_chars: int = 500, max_bits: int = 4096, max_digits: int = 1000, places: int = 12):
        self.max_chars, self.max_bits, self.max_digits, self.places = max_chars, max_bits, max_digits, places

    _BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}

    async def call(self, arguments: dict[str, Any]) -> str:
        return self.evaluate(arguments["expression"])

    def evaluate(self, expression: str) -> str:
        """The value of `expression` as text, or "error: calculator: ..."."""
        text = expression.strip().rstrip("=").strip()
        try:
            if len(text) > self.max_chars:
                raise ValueError(f"expression longer than {self.max_chars} characters")
            tree = ast.parse(text, mode="eval")
            return self._format(self._eval(tree.body, text))
        except SyntaxError:
            return f"{ERROR}calculator: not an arithmetic expression: {text[:100]!r}"
        except ZeroDivisionError:
            return f"{ERROR}calculator: division by zero"
        except (ValueError, RecursionError, MemoryError) as e:
            return f"{ERROR}calculator: {e or type(e).__name__}"

    def _eval(self, node: ast.AST, text: str) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.Constant) and type(node.value) is float:
            return Fraction(ast.get_source_segment(text, node))  # the literal as written: "0.1" is 1/10
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            value = self._eval(node.operand, text)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and (type(node.op) in self._BINARY or isinstance(node.op, ast.Pow)):
            left, right = self._eval(node.left, text), self._eval(node.right, text)
            if isinstance(node.op, ast.Pow):
                value = self._power(left, right)
            else:  # Fraction // Fraction is an int
                value = Fraction(self._BINARY[type(node.op)](left, right))
            if max(value.numerator.bit_length(), value.denominator.bit_length()) > self.max_bits:
                raise ValueError(f"intermediate result over {self.max_bits} bits")
            return value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
            raise ValueError("'^' is not a power here: write ** (2 ** 3)")
        raise ValueError(f"unsupported: {ast.get_source_segment(text, node)!r} "
                         "(only numbers, + - * / // % ** and parentheses)")

    def _power(self, base: Fraction, exponent: Fraction) -> Fraction:
        if exponent.denominator != 1:
            raise ValueError(f"exponent must be an integer, got {self._format(exponent)}")
        if base in (0, 1, -1):
            return base ** exponent.numerator
        # A lower bound on the result's size (within a factor 2), checked before computing it.
        bits = abs(exponent.numerator) * (max(base.numerator.bit_length(), base.denominator.bit_length()) - 1) + 1
        if bits > self.max_bits:
            raise ValueError(f"power too large (about {bits} bits; the limit is {self.max_bits})")
        return base ** exponent.numerator

    def _format(self, value: Fraction) -> str:
        if value.denominator == 1:
            text = str(value.numerator)
        else:
            den, twos, fives = value.denominator, 0, 0
            while den % 2 == 0:
                den, twos = den // 2, twos + 1
            while den % 5 == 0:
                den, fives = den // 5, fives + 1
            # Exact in max(twos, fives) places when the denominator is 2^a 5^b; otherwise rounded.
            places = max(twos, fives) if den == 1 else self.places
            scaled = round(value * 10 ** places)  # half-even
            sign, digits = "-" if scaled < 0 else "", str(abs(scaled)).rjust(places + 1, "0")
            text = f"{sign}{digits[:-places]}.{digits[-places:]}".rstrip("0").rstrip(".")
            text = "0" if text == "-0" else text
        if len(text) > self.max_digits:
            raise ValueError(f"result has {len(text)} digits (the limit is {self.max_digits})")
        return text
