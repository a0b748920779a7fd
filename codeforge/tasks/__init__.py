"""Task sets that own their examples, their prompt and their check.

- families.py    the procedural task families (string, list, arithmetic, dict;
                 three levels) and generate_tasks
- code_tasks.py  `codeforge make-tasks`: user task JSONL, the outside verdict, execution rewards, task prompts
- tool_calls.py  `codeforge make-tools`: synthetic tool-calling conversations, held-out cases, their scores
"""
