"""Data that ships with installed packages, and the user's own prompt and text files.

Everything here comes from packages installed from the package index (ARCHITECTURE.md,
"Data"), so nothing is downloaded at run time:
- ``packages``: locating the data packages (never importing them) and the default model;
- ``datasets``: the benchmark and evaluation sets (HumanEval, XSum, MMLU, ASDiv, BoolQ);
- ``calibration``: the calibration corpus and its held-out tails;
- ``user_files``: a user's prompt files (JSONL) and text files;
- ``jsonl``: reading JSONL with errors that name the file and line.
"""
