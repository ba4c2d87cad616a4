from django.core.management.base import BaseCommand

from models_catalog.services import seed_catalog


class Command(BaseCommand):
    help = (
        "Put the bundled SmolLM2-135M-Instruct model and its public serverless deployment "
        "(smollm2-135m-instruct) in the catalog. Safe to run again: existing rows are left as they are."
    )

    def handle(self, *args, **options):
        result = seed_catalog()
        for line in result.messages:
            self.stdout.write(line)
        for line in result.warnings:
            self.stderr.write(line)
