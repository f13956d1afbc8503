"""One GRPO step as a self-contained HTML page (`stage2_grpo.py --explain`, written to
--explain-html): the K completions of one group side by side, each headed by its reward terms
(Eqs. (4)-(7)) and its advantage (Eq. (8)), each token shaded by its ratio r = pi_theta / pi_old after
the update and outlined where Eq. (9)'s clip took it.

The page is one file with inline CSS and no script nor network asset, so that it opens from any disk,
offline, years later. Every number it shows is also on its element as a data attribute (written
with repr, so it parses back to the very float), which lets a test or a reader's script read the page
back: each completion `<section class="completion" data-k data-reward data-advantage data-format
data-recall data-answer>`, each token `<span class="tok" data-ratio data-kl data-clipped data-policy>`.

`step`, the plain dict srt/grpo_explain.py's explain builds:

    title, settings [(name, value), ...], prompt {id, history_turns, query_turn, query, recall, answer},
    tries, differs, clip_eps, beta, mean, std, update {loss, grad_norm, updates} (optional),
    completions [{k, format, recall, answer, total, advantage, tokens [str], marks [str] (optional:
                  what to show for a token that decodes to nothing, e.g. the stop token), ratio [float],
                  kl [float], clipped [bool], policy_mask [0|1]}]
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from srt.data_io import atomic_write_text, folder_write_error

# The mark of a page this module wrote: --explain replaces such a page, and refuses any other file.
GENERATOR = '<meta name="generator" content="srt/step_page.py">'

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em; color: #111; }
h1 { font-size: 1.3em; margin: 0 0 .4em; }
h2 { font-size: 1.05em; margin: 1.2em 0 .4em; }
table.kv td { padding: 0 .8em 0 0; vertical-align: top; }
.note { color: #555; }
.legend { border: 1px solid #ccc; padding: .6em 1em; background: #fafafa; max-width: 70em; }
.legend code, .formula { font-family: ui-monospace, monospace; }
.formula { white-space: pre-wrap; margin: .3em 0; }
.group { display: grid; gap: .8em; overflow-x: auto; padding-bottom: .5em; }
.completion { border: 1px solid #bbb; border-radius: 4px; min-width: 16em; }
.completion header { padding: .4em .6em; border-bottom: 1px solid #bbb; font-size: .9em; }
.completion header.plus { background: #fde8e8; }
.completion header.minus { background: #e6eefc; }
.completion header.zero { background: #f0f0f0; }
.completion header b { font-size: 1.05em; }
.text { padding: .5em .6em; white-space: pre-wrap; word-break: break-word;
        font-family: ui-monospace, monospace; font-size: .85em; line-height: 1.7; }
.tok { border-radius: 2px; }
.tok.clipped { outline: 2px solid #000; outline-offset: -1px; }
.tok.copied { color: #777; font-style: italic; background: #eee; }
.tok[data-mark]::after { content: attr(data-mark); color: #999; font-size: .8em; }
.swatch { display: inline-block; padding: 0 .4em; margin-right: .3em; border-radius: 2px; }
.swatch.clip { outline: 2px solid #000; outline-offset: -1px; }
.swatch.copied { color: #777; font-style: italic; background: #eee; }
"""


def number(x) -> str:
    """A float as a data attribute: repr reads back to the same float (nan and inf included)."""
    return repr(float(x))


def shade(ratio: float, clip_eps: float) -> str:
    """Background for a policy token: red where r > 1 (the update made it likelier), blue where r < 1,
    with an alpha that is full at the clip edge (r = 1 + eps, or 1 - eps) and the square root of
    |log r| / |log edge| below it, so that the small moves of one step at a low learning rate are
    still visible."""
    if not math.isfinite(ratio) or ratio <= 0 or ratio == 1:
        return ""
    log_r = math.log(ratio)
    edge = math.log(1 + clip_eps) if log_r > 0 else -math.log(max(1 - clip_eps, 1e-12))
    alpha = math.sqrt(min(1.0, abs(log_r) / edge))
    rgb = "220, 38, 38" if log_r > 0 else "37, 99, 235"
    return f"background: rgba({rgb}, {alpha:.3f});"


def token_span(text, ratio, kl, clipped, policy, mark, clip_eps) -> str:
    attrs = {
        "data-ratio": number(ratio),
        "data-kl": number(kl),
        "data-clipped": "1" if clipped else "0",
        "data-policy": "1" if policy else "0",
    }
    if policy:
        classes = "tok clipped" if clipped else "tok"
        style = shade(ratio, clip_eps)
        attrs["title"] = f"r = {ratio:.6g}, k3 KL = {kl:.3g}" + (" (clipped: no gradient)" if clipped else "")
    else:  # a turn copied out by the decoder (--recall copy): outside every term of Eq. (9)
        classes, style = "tok copied", ""
        attrs["title"] = "written by the program, not sampled: outside Eq. (9)"
    if style:
        attrs["style"] = style
    if mark and not text:
        attrs["data-mark"] = mark
    joined = " ".join(f'{key}="{html.escape(value, quote=True)}"' for key, value in attrs.items())
    return f'<span class="{classes}" {joined}>{html.escape(text, quote=False)}</span>'


def completion_section(row: dict, clip_eps: float) -> str:
    A = float(row["advantage"])
    sign = "plus" if A > 0 else "minus" if A < 0 else "zero"
    policy = [int(p) for p in row["policy_mask"]]
    sampled = sum(policy)

    def mean_of(values):  # over the policy's tokens only, as Eq. (9) averages them
        return sum(v for v, p in zip(values, policy) if p) / max(sampled, 1)

    clip_share = sum(1 for c, p in zip(row["clipped"], policy) if c and p) / max(sampled, 1)
    attrs = " ".join(
        f'data-{name}="{number(row[key])}"'
        for name, key in (
            ("reward", "total"),
            ("advantage", "advantage"),
            ("format", "format"),
            ("recall", "recall"),
            ("answer", "answer"),
        )
    )
    head = (
        f'<header class="{sign}"><b>k = {row["k"]}</b>: R = {row["total"]:.4f} = '
        f"{row['format']:.2f} + {row['recall']:.4f} + {row['answer']:.4f} "
        f"<span class='note'>(format + recall + answer)</span><br>"
        f"<b>A~ = {A:+.4f}</b> &middot; {len(policy)} tokens, {len(policy) - sampled} written by the "
        f"program &middot; mean r {mean_of(row['ratio']):.6f} &middot; clipped {clip_share:.1%} "
        f"&middot; mean k3 KL {mean_of(row['kl']):.2e}</header>"
    )
    marks = row.get("marks") or [""] * len(row["tokens"])
    spans = "".join(
        token_span(*cells, clip_eps)
        for cells in zip(row["tokens"], row["ratio"], row["kl"], row["clipped"], policy, marks)
    )
    return (
        f'<section class="completion" data-k="{row["k"]}" {attrs}>{head}'
        f'<div class="text">{spans}</div></section>'
    )


def legend(step: dict) -> str:
    eps, beta = step["clip_eps"], step["beta"]
    up, down = shade(1 + eps, eps), shade(1 - eps, eps)
    little_up, little_down = shade(1.01, eps), shade(0.99, eps)
    return f"""<div class="legend">
<p><b>Shading.</b> Each token the policy sampled is coloured by its ratio r = pi_theta / pi_old,
pi_theta after this step's update, pi_old before it:
<span class="swatch" style="{little_up}">r = 1.01</span>
<span class="swatch" style="{up}">r = {1 + eps:g}</span> made likelier (red),
<span class="swatch" style="{little_down}">r = 0.99</span>
<span class="swatch" style="{down}">r = {1 - eps:g}</span>
made less likely (blue); full colour at the clip edge 1 &plusmn; eps, and sqrt(|log r| / |log edge|)
below it. <span class="swatch clip">outlined</span>: clipped, i.e. (r &gt; 1 + eps and A~ &gt; 0)
or (r &lt; 1 - eps and A~ &lt; 0); min() then takes the constant clip(r) A~, and the token gives no
gradient. <span class="swatch copied">grey italic</span>: written by the program, not the policy
(a turn copied out under --recall copy): attended to, outside every term of Eq. (9).
Small grey text (a name, or a dot): a token that adds no text of its own, such as the stop token
or part of a character that a later token completes. Hover a token for its r and k3 KL to pi_ref.</p>
<p class="formula">Eq. (8)  A~(k) = (R(k) - mean_j R(j)) / (std_j R(j) + 1e-8)    (std: divide by K)
Eq. (9)  J = 1/G sum_i 1/|o_i| sum_t [ min(r_it A~_i, clip(r_it, 1 - eps, 1 + eps) A~_i) - beta KL_it ]
         r_it = pi_theta(o_it | q, o_i,&lt;t) / pi_old(o_it | q, o_i,&lt;t)
         KL_it = exp(log pi_ref - log pi_theta) - (log pi_ref - log pi_theta) - 1   (k3, per token, &gt;= 0)
         the loss minimised is -J;  eps = {eps:g}, beta = {beta:g}</p>
</div>"""


def render_step_page(step: dict) -> str:
    prompt, e = step["prompt"], html.escape
    settings = "".join(f"<tr><td>{e(str(k))}</td><td>{e(str(v))}</td></tr>" for k, v in step["settings"])
    tries = f"{step['tries']} group(s) sampled; " + (
        "this is the first whose K rewards differ."
        if step["differs"]
        else "none had K rewards that differ: this one is shown anyway, and teaches nothing."
    )
    update = step.get("update")
    update_line = (
        f"<p>The update: {update['updates']} AdamW step(s), mean loss {update['loss']:.6f}, mean gradient "
        f"norm {update['grad_norm']:.4f}.</p>"
        if update
        else ""
    )
    K = len(step["completions"])
    sections = "".join(completion_section(row, step["clip_eps"]) for row in step["completions"])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
{GENERATOR}
<title>{e(step["title"])}</title>
<style>{CSS}</style></head>
<body>
<h1>{e(step["title"])}</h1>
<p>Record {e(str(prompt["id"]))}, {prompt["history_turns"]} utterances of history, query
Q{prompt["query_turn"]}: <q>{e(prompt["query"])}</q><br>
H* = {e(", ".join(prompt["recall"]) or "(none)")}; A* = <q>{e(prompt["answer"])}</q>
<span class="note">(the reward's answer key, never in the prompt)</span></p>
<p>{e(tries)} Group: mean R = {step["mean"]:.4f}, std R = {step["std"]:.4f}.</p>
{update_line}
<table class="kv">{settings}</table>
<h2>How to read it</h2>
{legend(step)}
<h2>The K = {K} completions</h2>
<div class="group" style="grid-template-columns: repeat({K}, minmax(16em, 1fr));">{sections}</div>
</body></html>
"""


def page_problem(path, overwrite: bool = False) -> str | None:
    """Why --explain-html `path` must not be written, or None: a folder, or a file that is not a
    page written here (the user's data, a run's config.json) unless `overwrite`."""
    path = Path(path)
    if path.is_dir():
        return f"--explain-html {path} is a folder; give the path of the page to write"
    if path.exists() and not overwrite:
        with open(path, "rb") as f:
            head = f.read(4096)
        # a page of an earlier version, before the mark, is told by its doctype and its CSS
        earlier = head.startswith(b"<!DOCTYPE html>") and b".tok.clipped {" in head
        if GENERATOR.encode() not in head and not earlier:
            return (
                f"--explain-html {path} holds a file that is not a page --explain wrote; give another "
                "path, or --overwrite to replace it"
            )
    return None


def unwritable(path) -> str | None:
    """Why no page can be written at `path`, or None: found by making its folder and a file in it
    (as root, a read-only folder passes os.access), before the step that would end in it runs."""
    why = folder_write_error(Path(path).parent)
    return None if why is None else f"--explain-html {path}: cannot write a page there ({why})"


def write_step_page(path, step: dict) -> str:
    """Write the page of `step` to `path` atomically (a killed run leaves no half page). -> path."""
    atomic_write_text(path, render_step_page(step))
    return str(path)
