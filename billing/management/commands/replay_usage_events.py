from django.core.management.base import BaseCommand

from billing import selectors, services


class Command(BaseCommand):
    help = (
        "Record again the usage events billing refused and kept (malformed, or naming an organization "
        "or model it did not know), once their cause is fixed: a catalog model put back, billing workers "
        "upgraded. Recording is idempotent, so a replay never charges a request twice."
    )

    def add_arguments(self, parser):
        parser.add_argument("--list", dest="only_list", action="store_true",
                            help="list the refused events waiting, and replay nothing")

    def handle(self, *args, only_list=False, **options):
        waiting = selectors.refused_usage_events()
        if only_list or not waiting:
            for kept in waiting:
                self.stdout.write(f"{kept.refused_at:%Y-%m-%d %H:%M:%S} {kept.request_id or '(no request id)'}: "
                                  f"{kept.error}")
            self.stdout.write(f"{len(waiting)} refused usage events waiting.")
            return
        outcome = services.replay_refused_events()
        self.stdout.write(f"{outcome.recorded} recorded, {outcome.refused} refused again "
                          "(see --list for why; fix the cause and run this again).")
