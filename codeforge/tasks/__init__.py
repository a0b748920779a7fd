"""Task sets that own their examples, their prompt and their check.

- code_tasks.py  `codeforge make-tasks`: programming tasks with hidden tests, execution rewards, task prompts
- tool_calls.py  `codeforge make-tools`: synthetic tool-calling conversations, held-out cases, their scores
"""
