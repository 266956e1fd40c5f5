"""The embedded demo's fixtures: a tiny Llama and tokenizer built on the fly, and an arithmetic task with a
checkable reward. Tests, benchmarks and `launch.demo` use them; no role imports them. Imports nothing of the project."""
