"""Structured outputs: constrain what a request may generate with a grammar (xgrammar).

A request's ``SamplingParams.structured_outputs`` (a JSON schema, any JSON object, a
regex, a choice of strings or an EBNF grammar) is compiled once per distinct
constraint (``backend``: an LRU cache over xgrammar's compiler) into a grammar; the
``manager`` keeps one matcher per request and, each step, fills a token bitmask row for
every constrained request that samples (``bitmask``); the sampler applies it before
anything else; accepted tokens then advance the matchers. Matchers follow the request's
own token list, so they can never drift from it (see ``manager``).

May import: torch, xgrammar (lazily: the first constrained request pays for it),
``kvpilot.engine.core`` and the sampling parameters.
"""

from kvpilot.engine.structured_output.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
