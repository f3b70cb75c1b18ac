"""``Unsupported``: an implementation under test cannot run a case (a mode it lacks); properties
record it as "n/a" with the reason instead of a failure."""


class Unsupported(Exception):
    """Raised by an implementation wrapper for a mode it does not offer (e.g. PEFT and
    ``detach_norm=False``); the message says what and why."""
