"""DAPO's math check (env.math.math_verify_impl: dapo_math_verify in NeMo RL, verl's math_dapo reward).

The prediction is the text of the last "Answer: ..." line within the response's final 300 characters; it and the
ground truth are normalized as Minerva's final answers are (units and filler words dropped, TeX shorthand
expanded, thousands separators removed), and the two strings must be equal. No sympy: it is fast and pure, so
it runs in the environment's own process. The rules follow the DAPO recipe so that a score here means what it
means there.
"""

from __future__ import annotations

import re

ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
TAIL_CHARS = 300
"""Only the response's end is searched (the longest MATH-500 answer is 159 characters)."""
NO_ANSWER = "[INVALID]"

_REPLACED = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
             (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
"""In order: filler words, spaces and TeX spacing go; "and" between items becomes a comma."""
_DROPPED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
            r",\!", "{,}", '"', "\\dots")
"""Units and TeX decorations removed, in order (a unit name inside a longer word goes too, as in the recipe)."""
_REWRITES = ((re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),  # the first $...$ span alone
             (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
             (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
             (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
             (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
             (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),  # \frac12 -> \frac{1}{2}
             (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"))  # \sqrt2 -> \sqrt{2}


def dapo_verify(response: str, ground_truth: str) -> tuple[float, str]:
    """(1.0 if the normalized prediction equals the normalized ground truth else 0.0, the normalized prediction)."""
    found = ANSWER_LINE.findall(response[-TAIL_CHARS:])
    prediction = normalize(found[-1] if found else NO_ANSWER)
    return (1.0 if prediction == normalize(ground_truth) else 0.0), prediction


def normalize(answer: str) -> str:
    """Minerva's normalization of a final answer: what follows the last "=", cleaned to a canonical string."""
    text = answer.split("=")[-1]
    for old, new in _REPLACED:
        text = text.replace(old, new)
    for dropped in _DROPPED:
        text = text.replace(dropped, "")
    for pattern, replacement in _REWRITES:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()
