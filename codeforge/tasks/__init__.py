"""Task sets that own their examples, their prompt and their check.

- families.py    the procedural task families (string, list, arithmetic, dict; three levels), generate_tasks
- code_tasks.py  `codeforge make-tasks`: user task JSONL, execution rewards, task checks, task prompts
- verdict.py     the verdict outside the box: tests split into calls and expected values, or recorded on the
                 reference solution; the returned values judged here
- tool_calls.py  `codeforge make-tools`: synthetic tool-calling conversations, held-out cases, their scores
- options.py     the options of make-tasks and make-tools, declared once (their flags are made from them)
"""
