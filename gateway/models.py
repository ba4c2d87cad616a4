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
