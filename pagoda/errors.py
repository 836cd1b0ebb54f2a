"""Errors a request can cause, raised by the layer that finds them and answered by the front.

Low in the package on purpose: SamplingParams, the tokenizer and the engine all raise
`InvalidRequest`, and the server turns it into OpenAI's 400 body without guessing what it is
about (`param` and `code` travel with it). It subclasses ValueError, so offline callers that
catch ValueError keep working.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine cannot serve as asked; the client must change it.

    `param` names the request field at fault in the engine's terms ("prompt", "max_tokens",
    "messages", a SamplingParams field); a front whose API names it differently renames it
    (chat: "prompt" -> "messages"). `code` is a stable machine-readable reason when there is
    one (OpenAI's "context_length_exceeded").
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def renamed(self, names: dict[str, str]) -> InvalidRequest:
        """The same error with `param` in another API's terms (unmapped names stay)."""
        if self.param is None or self.param not in names:
            return self
        return InvalidRequest(self.message, param=names[self.param], code=self.code)

    def __reduce__(self):  # keeps param and code across Ray's serialization (a Ray replica's refusals)
        return (_rebuild, (self.message, self.param, self.code))


def _rebuild(message: str, param: str | None, code: str | None) -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)
