from django.core.management.base import BaseCommand, CommandError

from models_catalog.errors import ModelImportError
from models_catalog.services import PRICE_FIELDS
from workers.model_import import import_model


class Command(BaseCommand):
    help = (
        "Add a GGUF file or a Hugging Face safetensors folder under MODELS_ROOT to the catalog, "
        "reading its architecture, parameter count, quantization and context length from the file; refused, "
        "with the reason, when the engine could not run it."
    )

    def add_arguments(self, parser):
        parser.add_argument("path", help="the weights file or folder, absolute or relative to MODELS_ROOT")
        parser.add_argument("--slug", default=None, help="catalog slug (default: from the file name)")
        parser.add_argument("--display-name", default=None, help="name shown in the catalog (default: from the file)")
        parser.add_argument("--description", default="", help="description shown in the catalog")
        for field in PRICE_FIELDS:
            parser.add_argument(f"--{field.replace('_', '-')}", dest=field, default=None,
                                help=f"{field} in USD (default 0; at most 6 decimal places)")

    def handle(self, *args, **options):
        prices = {field: options[field] for field in PRICE_FIELDS if options[field] is not None}
        try:
            model = import_model(
                path=options["path"], slug=options["slug"], display_name=options["display_name"],
                description=options["description"], **prices,
            )
        except ModelImportError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(
            f"imported {model.slug}: {model.architecture}, {model.parameter_count:,} parameters, "
            f"{model.quantization}, context {model.context_length}"
        )
