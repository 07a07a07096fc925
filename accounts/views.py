from django.contrib.auth.decorators import login_required
from django.shortcuts import render


@login_required
def token_list(request):
    return render(request, "accounts/token_list.html", {"tokens": request.user.api_tokens.all()})
