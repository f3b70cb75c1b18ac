"""Integrations with training libraries (PEFT first): ``doracheck.integrations.peft``."""
