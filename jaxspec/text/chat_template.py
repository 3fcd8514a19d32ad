"""Chat templates: Jinja2 (a base dependency) rendered in a sandbox, the way HF transformers renders
them (`messages`, `add_generation_prompt`, the special tokens, `raise_exception`, `strftime_now`, the
`tojson` filter), within step, size and time limits."""
from __future__ import annotations

import json


class TokenizerError(ValueError):
    """A tokenizer file is missing or unusable, or its chat template fails (the CLI reports it as bad input)."""


# A chat template comes with the model's files: untrusted code, rendered in Jinja's sandbox and within
# these limits, so that a runaway or hostile one fails fast (TokenizerError naming the limit) instead
# of hanging the generation. A real chat template runs a few dozen lines per message.
TEMPLATE_MAX_STEPS = 1_000_000   # template lines executed (Python line events in the compiled template)
TEMPLATE_MAX_CHARS = 1 << 24     # characters rendered, and the size of any string / list one +, * builds
TEMPLATE_MAX_SECONDS = 10.0      # wall clock


def render_chat_template(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                         **variables) -> str:
    """Render a Jinja2 chat template in a sandbox (as HF transformers does), within
    TEMPLATE_MAX_STEPS / TEMPLATE_MAX_CHARS / TEMPLATE_MAX_SECONDS (TokenizerError past one)."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise TokenizerError("chat templates need jinja2: pip install jinja2") from None
    import datetime
    import sys

    def raise_exception(message):
        raise TokenizerError(f"chat template error: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Codegen(jinja2.compiler.CodeGenerator):
        def visit_Concat(self, node, frame):
            # `a ~ b`: the parts go to checked_concat with the join Jinja would use (markup_join when
            # autoescaping), which runs only once their sizes add up to within the limit
            if frame.eval_ctx.volatile:
                join = "(markup_join if context.eval_ctx.volatile else str_join)"
            else:
                join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
            self.write(f"environment.checked_concat({join}, (")
            for part in node.nodes:
                self.visit(part, frame)
                self.write(", ")
            self.write("))")

    class Env(ImmutableSandboxedEnvironment):
        # the one-line ways to build a huge value ("x" * 10**10, 10 ** 10**9, s + s doubling, "%9999999s" % x)
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        code_generator_class = Codegen

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's convention)
            args = _check_str_method(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):
            fmt = super().wrap_str_format(value)
            if fmt is None:
                return None

            def checked(*args, **kwargs):
                _check_widths(value.__self__, "{}", list(args) + list(kwargs.values()))
                return fmt(*args, **kwargs)
            return checked

        def checked_concat(self, join, parts):
            parts = [str(p) for p in parts]
            _too_big(sum(map(len, parts)), "a ~")
            return join(parts)

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    _checked_filters(env)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(template)
        pieces, size = [], 0
        with _TemplateBudget():
            for piece in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                           **variables):
                size += len(piece)
                if size > TEMPLATE_MAX_CHARS:
                    raise TokenizerError(f"chat template error: its output passed {TEMPLATE_MAX_CHARS:,} characters "
                                         "(TEMPLATE_MAX_CHARS)")
                pieces.append(piece)
        return "".join(pieces)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template error: {e}") from None
    except RecursionError as e:  # the template's own error (e.g. a macro calling itself), not jaxspec's
        raise TokenizerError(f"chat template error: {_recursing(e.__traceback__)} recurses past Python's "
                             f"limit ({sys.getrecursionlimit():,} calls deep)") from None
    except TokenizerError:
        raise
    except Exception as e:  # e.g. center(1.5): a TypeError of the template's own code, not a jaxspec bug
        raise TokenizerError(f"chat template error: {type(e).__name__}: {e}") from None


def _check_binop(operator, left, right) -> None:
    """TokenizerError before a +, * or ** whose result would pass TEMPLATE_MAX_CHARS (strings, lists)
    or 65,536 bits (integers)."""
    seq = (str, list, tuple)
    if operator == "*" and isinstance(left, int) and isinstance(right, seq):
        left, right = right, left
    if operator == "%":
        if isinstance(left, str):
            _check_widths(left, "%", right if isinstance(right, tuple) else [right])
        return
    if operator == "*" and isinstance(left, seq) and isinstance(right, int):
        size = len(left) * right
    elif operator == "+" and isinstance(left, seq) and isinstance(right, seq):
        size = len(left) + len(right)
    elif (operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1
          and right * abs(left).bit_length() > 1 << 16):
        raise TokenizerError(f"chat template error: {left} ** {right} is past the template's 65,536-bit integer "
                             "limit")
    else:
        return
    if size > TEMPLATE_MAX_CHARS:
        raise TokenizerError(f"chat template error: a {operator} would build {size:,} items, past "
                             f"{TEMPLATE_MAX_CHARS:,} (TEMPLATE_MAX_CHARS)")


def _recursing(tb) -> str:
    """What recursed, from a RecursionError's traceback: the macro Jinja was calling most often
    ("macro 'name'"), else "the template"."""
    from collections import Counter

    from jinja2.runtime import Macro

    names = Counter()
    while tb is not None:
        me = tb.tb_frame.f_locals.get("self")
        if isinstance(me, Macro):
            names[me.name] += 1
        tb = tb.tb_next
    return f"macro {names.most_common(1)[0][0]!r}" if names else "the template"


def _too_big(size, what: str) -> None:
    if size > TEMPLATE_MAX_CHARS:
        raise TokenizerError(f"chat template error: {what} would build {size:,} characters, past "
                             f"{TEMPLATE_MAX_CHARS:,} (TEMPLATE_MAX_CHARS)")


def _number(x) -> float:
    """A width or count argument as a number (0 when it is not one: Python refuses it later)."""
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else 0


_WIDTH = {"%": r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?",  # %-10.3f, %*s (re caches them compiled)
          "{}": r"\{[^{}:!]*(?:![rsa])?:(?:[^{}]?[<>=^])?[-+ ]?z?#?0?(\{[^{}]*\}|\d*)[,_]?(?:\.(\{[^{}]*\}|\d*))?"}


def _check_widths(fmt: str, style: str, args) -> None:
    """TokenizerError before formatting `fmt` (% or {} style) with a width or precision past
    TEMPLATE_MAX_CHARS, written in it or taken from the arguments (`*`, `{}` inside a field)."""
    import re

    for m in re.finditer(_WIDTH[style], fmt):
        for n in m.groups():
            if n and n.isdigit():
                _too_big(int(n), f"a format width of {int(n):,}")
            elif n:  # from the arguments: the largest number among them bounds it
                _too_big(max((_number(a) for a in args), default=0), "a format width from its arguments")


def _check_str_method(fn, args, kwargs) -> tuple:
    """TokenizerError before a str method called in a template builds a string past
    TEMPLATE_MAX_CHARS (center / ljust / rjust / zfill widths, expandtabs, replace, join); returns
    `args` (join's iterable as a list, so it is read once)."""
    s, name = getattr(fn, "__self__", None), getattr(fn, "__name__", "")
    if not isinstance(s, str) or not args:
        return args
    if name in ("center", "ljust", "rjust", "zfill"):
        _too_big(_number(args[0]), f"{name}({args[0]!r})")
    elif name == "expandtabs":
        _too_big(len(s) * _number(args[0]), f"expandtabs({args[0]!r})")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        n = s.count(args[0]) if args[0] else len(s) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            n = min(n, args[2])
        _too_big(len(s) + n * max(len(args[1]) - len(args[0]), 0), "a replace")
    elif name == "join":
        items = list(args[0])
        _too_big(len(s) * max(len(items) - 1, 0) + sum(len(x) for x in items if isinstance(x, str)), "a join")
        args = (items,) + tuple(args[1:])
    return args


def _checked_filters(env) -> None:
    """Jinja's filters that build a string from a size argument, checked before they run:
    center, indent, format (widths), join and replace (the sizes they would join up to)."""
    import jinja2

    f = dict(env.filters)

    def center(value, width=80):
        _too_big(_number(width), f"center({width!r})")
        return f["center"](value, width)

    def indent(s, width=4, first=False, blank=False):
        pad = len(width) if isinstance(width, str) else _number(width)
        _too_big(len(str(s)) + pad * (str(s).count("\n") + 1), f"indent({width!r})")
        return f["indent"](s, width, first, blank)

    def format_(value, *args, **kwargs):
        _check_widths(str(value), "%", list(args) + list(kwargs.values()))
        return f["format"](value, *args, **kwargs)

    @jinja2.pass_eval_context
    def join(eval_ctx, value, d="", attribute=None):
        items = list(value)
        if attribute is not None:
            items = [env.getitem(x, attribute) for x in items]
        _too_big(len(str(d)) * max(len(items) - 1, 0) + sum(len(str(x)) for x in items), "a join")
        return f["join"](eval_ctx, items, d)

    @jinja2.pass_eval_context
    def replace(eval_ctx, s, old, new, count=None):
        text, old, new = str(s), str(old), str(new)
        n = text.count(old) if old else len(text) + 1
        n = n if count is None or not isinstance(count, int) or count < 0 else min(n, count)
        _too_big(len(text) + n * max(len(new) - len(old), 0), "a replace")
        return f["replace"](eval_ctx, s, old, new, count)

    env.filters.update(center=center, indent=indent, format=format_, join=join, replace=replace)


class _TemplateBudget:
    """Counts the lines the compiled template runs (sys.settrace on this thread; Jinja compiles a
    template to Python code named "<template>", everything else is left untraced) and raises
    TokenizerError past TEMPLATE_MAX_STEPS lines or TEMPLATE_MAX_SECONDS. The previous tracer (a
    debugger, coverage) is restored after."""

    def __enter__(self):
        import sys
        import time

        self._clock = time.monotonic
        self.steps, self.deadline = 0, self._clock() + TEMPLATE_MAX_SECONDS
        self.previous = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc):
        import sys

        sys.settrace(self.previous)

    def _call(self, frame, event, arg):
        return self._line if frame.f_code.co_filename == "<template>" else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.steps += 1
            if self.steps > TEMPLATE_MAX_STEPS:
                raise TokenizerError(f"chat template error: it ran past {TEMPLATE_MAX_STEPS:,} steps "
                                     "(TEMPLATE_MAX_STEPS): a runaway loop?")
            if not self.steps % 256 and self._clock() > self.deadline:
                raise TokenizerError(f"chat template error: it ran past {TEMPLATE_MAX_SECONDS:g} s "
                                     "(TEMPLATE_MAX_SECONDS)")
        return self._line
