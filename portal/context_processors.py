from django.conf import settings

from portal.localmail import where_mail_goes


def site(request):
    """The site's own URL, for templates that print commands to copy, and where mail
    goes when the portal sends none (local mode), for pages that say "check your mail"."""
    return {"SITE_URL": settings.SITE_URL, "LOCAL_MAILBOX": where_mail_goes()}
