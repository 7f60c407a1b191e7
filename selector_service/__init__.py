"""The stateless backend selector: which attention backend the target and its drafter use, and why."""
