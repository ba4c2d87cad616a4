"""What the gateway keeps: Responses API responses stored for later turns and reads."""

from django.db import models


class StoredResponse(models.Model):
    """A response of ``POST /v1/responses`` kept (OpenAI's ``store``, on by default) so that
    ``GET /v1/responses/{id}`` reads it and a later request continues it with
    ``previous_response_id``; for RESPONSES_RETENTION_DAYS after its creation.

    ``conversation`` holds every input item the response answered, those of the responses it
    continued included: a row is whole on its own, so deleting one response never breaks another.
    Both columns are JSON text, not a JSON column: a client's text may hold what jsonb refuses
    (``\\u0000``, a lone surrogate)."""

    id = models.CharField(primary_key=True, max_length=64)
    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(db_index=True)
    conversation = models.TextField(help_text="The input items, as JSON text.")
    response = models.TextField(help_text="The response object, as JSON text.")

    class Meta:
        ordering = ["created_at"]

    def __str__(self) -> str:
        return self.id


class UploadedFile(models.Model):
    """A file of the Files API: a batch's input (JSONL) uploaded by a client, or a batch's output
    or errors written by the platform."""

    class Purpose(models.TextChoices):
        BATCH = "batch", "batch input"
        BATCH_OUTPUT = "batch_output", "batch output"

    id = models.CharField(primary_key=True, max_length=40)
    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE, related_name="+")
    purpose = models.CharField(max_length=16, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    size = models.PositiveBigIntegerField()
    created_at = models.DateTimeField()
    # False while its chunks are being written, each in a short transaction of its own (a long one
    # would hold SQLite's one write lock): nobody sees a file before it is whole.
    ready = models.BooleanField(default=True)

    class Meta:
        ordering = ["created_at"]

    def __str__(self) -> str:
        return self.id


class FileChunk(models.Model):
    """A piece of a file's content, numbered from 0, each but the last CHUNK_BYTES long: a file is
    written and read a chunk at a time, so that none has to fit in memory or in one database value
    (a batch's answers may come to gigabytes)."""

    CHUNK_BYTES = 1 << 20

    file = models.ForeignKey(UploadedFile, on_delete=models.CASCADE, related_name="chunks")
    index = models.PositiveIntegerField()
    data = models.BinaryField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["file", "index"], name="file_chunk_index_unique")]


class Batch(models.Model):
    """A Batch API job: the requests of an input file, run in the background at a discount, whose
    answers are written to an output file (and the failures to an error file)."""

    class Status(models.TextChoices):
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    id = models.CharField(primary_key=True, max_length=40)
    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE, related_name="+")
    api_key = models.ForeignKey("accounts.ApiKey", null=True, on_delete=models.SET_NULL, related_name="+",
                                help_text="The key that created it: its requests run, and are billed, as this key's.")
    endpoint = models.CharField(max_length=40)
    model = models.CharField(max_length=200)
    input_file_id = models.CharField(max_length=40)
    requests = models.TextField(help_text="The input's requests as JSON text ([{custom_id, body}]), kept whole "
                                          "even if the input file is deleted.")
    total = models.PositiveIntegerField()
    completion_window = models.CharField(max_length=8)
    metadata = models.JSONField(default=dict)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.IN_PROGRESS)
    output_file_id = models.CharField(max_length=40, null=True)
    error_file_id = models.CharField(max_length=40, null=True)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True)
    finalizing_at = models.DateTimeField(null=True)
    completed_at = models.DateTimeField(null=True)
    expired_at = models.DateTimeField(null=True)
    cancelling_at = models.DateTimeField(null=True)
    cancelled_at = models.DateTimeField(null=True)
    runner = models.CharField(max_length=32, blank=True, help_text="The token of the task running it (its lease).")
    runner_seen_at = models.DateTimeField(null=True, help_text="The last sign of life of the task running it.")

    class Meta:
        ordering = ["created_at"]
        indexes = [models.Index(fields=["status", "runner_seen_at"])]

    def __str__(self) -> str:
        return self.id


class BatchOutcome(models.Model):
    """What one request of a batch came to: its status code and body (the response, or the error)."""

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="outcomes")
    line = models.PositiveIntegerField()
    request_id = models.CharField(max_length=64, blank=True)
    status_code = models.PositiveSmallIntegerField()
    body = models.TextField(help_text="The response body, or the error, as JSON text.")
    input_tokens = models.PositiveIntegerField(default=0)
    # Of the input tokens, those the prefix cache served (db_default: an older runner still writes).
    cached_tokens = models.PositiveIntegerField(default=0, db_default=0)
    output_tokens = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["batch", "line"], name="batch_outcome_line_unique")]
