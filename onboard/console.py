"""The one rich console every stage reports progress on (stderr, so stdout stays for results)."""

from rich.console import Console

console = Console(stderr=True)
