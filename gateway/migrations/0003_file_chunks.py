"""Files' content moves into chunks (``FileChunk``), so that no file is one database value."""

from django.db import migrations, models
import django.db.models.deletion

CHUNK_BYTES = 1 << 20  # FileChunk.CHUNK_BYTES when this was written
ONE_VALUE_MAX = 1 << 30  # PostgreSQL's largest value (SQLite's is a little smaller)


def split_contents(apps, schema_editor):
    files, chunks = apps.get_model("gateway", "UploadedFile"), apps.get_model("gateway", "FileChunk")
    for file_id in files.objects.values_list("pk", flat=True).iterator():
        content = bytes(files.objects.filter(pk=file_id).values_list("content", flat=True).get())
        chunks.objects.bulk_create(chunks(file_id=file_id, index=index, data=content[start:start + CHUNK_BYTES])
                                   for index, start in enumerate(range(0, len(content), CHUNK_BYTES)))


def join_chunks(apps, schema_editor):
    files, chunks = apps.get_model("gateway", "UploadedFile"), apps.get_model("gateway", "FileChunk")
    too_big = files.objects.filter(size__gte=ONE_VALUE_MAX).values_list("pk", flat=True).first()
    if too_big is not None:
        raise RuntimeError(f"cannot migrate back: file {too_big} is too large for one database value; delete it first")
    for file_id in files.objects.values_list("pk", flat=True).iterator():
        parts = chunks.objects.filter(file_id=file_id).order_by("index").values_list("data", flat=True)
        files.objects.filter(pk=file_id).update(content=b"".join(bytes(part) for part in parts))


class Migration(migrations.Migration):

    dependencies = [("gateway", "0002_batches")]

    operations = [
        migrations.CreateModel(
            name="FileChunk",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("index", models.PositiveIntegerField()),
                ("data", models.BinaryField()),
                ("file", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="chunks",
                                           to="gateway.uploadedfile")),
            ],
            options={"constraints": [models.UniqueConstraint(fields=("file", "index"), name="file_chunk_index_unique")]},
        ),
        migrations.AddField(model_name="uploadedfile", name="ready", field=models.BooleanField(default=True)),
        migrations.AlterField(model_name="uploadedfile", name="content", field=models.BinaryField(default=b"")),
        migrations.RunPython(split_contents, join_chunks),
        migrations.RemoveField(model_name="uploadedfile", name="content"),
    ]
