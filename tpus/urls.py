from django.urls import path

from tpus import views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("labs/", views.lab_list, name="lab_list"),
]
