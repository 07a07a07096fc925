from django.conf import settings


def site(request):
    """The site's own URL, for templates that print commands to copy."""
    return {"SITE_URL": settings.SITE_URL}
