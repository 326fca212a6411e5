"""What a row becomes: prompts, one class per task (generate, label by choices / parsing / fields, eval,
embed, classify, score, OpenAI Batch lines), eval scores, OpenAI Batch request and response lines, the
output table. The engine, through its protocol; no Ray, no storage."""
from pipeline.errors import TemplateError
from pipeline.tasks.engines import build_engine, empty_device_cache, is_out_of_memory, start_engine
from pipeline.tasks.openai_batch.requests import BatchRequest, parse_messages, parse_request
from pipeline.tasks.openai_batch.responses import Choice, TokenLogprob, error_line, output_lines, request_for, response_line
from pipeline.tasks.prompts import PromptBuilder, check_prompt, parse_template
from pipeline.tasks.row_result import RowResult
from pipeline.tasks.grading import Normalizer, extract_answer, group_key, normalize, score_columns, score_row
from pipeline.tasks.table import COLUMN_TYPES, column_type, output_table
from pipeline.tasks.generate import NO_MATCH, row_seed
from pipeline.tasks.task import Request, RowError, Task
from pipeline.tasks.task_runner import TaskRunner, task_for

__all__ = ["COLUMN_TYPES", "NO_MATCH", "BatchRequest", "Choice", "Normalizer", "PromptBuilder", "RowResult",
           "TaskRunner", "Task", "Request", "RowError", "task_for", "TemplateError", "TokenLogprob", "build_engine", "check_prompt",
           "column_type", "empty_device_cache", "error_line", "extract_answer", "group_key", "is_out_of_memory",
           "normalize", "output_lines", "output_table", "parse_messages", "parse_request", "parse_template",
           "request_for", "response_line", "row_seed", "score_columns", "score_row", "start_engine"]
