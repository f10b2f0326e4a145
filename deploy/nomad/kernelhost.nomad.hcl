# One kernelhost node on every Nomad client (deploy/README.md). The secrets come from Nomad
# Variables: nomad var put nomad/jobs/kernelhost store_url=... cluster_secret=... api_keys=...
job "kernelhost" {
  type = "system"

  group "node" {
    network {
      port "http" {
        static = 8999
      }
    }

    task "kernelhost" {
      # on the host itself, a checkout in /opt/kernelhost set up by scripts/install-deps.sh:
      # libvirtd and QEMU run as root beside the service. The wrapper starts libvirt's daemons
      # (scripts/start-libvirt.sh), builds or reuses the guest images, then runs kernelhost serve.
      driver = "raw_exec"

      config {
        command = "/opt/kernelhost/deploy/entrypoint.sh"
      }

      # time for the service to stop cleanly (hibernating its sandboxes); the client's
      # max_kill_timeout (30s by default) must allow it
      kill_signal  = "SIGTERM"
      kill_timeout = "120s"

      env {
        KERNELHOST_NODE_ID            = "${node.unique.name}"
        # other nodes' calls are signed with a key derived from cluster_secret (never sent) and
        # valid for 30 s: keep clocks in sync; https:// + TLS settings on an untrusted network
        # (docs/cluster.md, "Between nodes")
        KERNELHOST_ADVERTISE_URL      = "http://${attr.unique.network.ip-address}:8999"
        KERNELHOST_NODE_LEASE_SECONDS = "15"
        KERNELHOST_HOST               = "0.0.0.0"
        KERNELHOST_PORT               = "8999"
        KERNELHOST_STATE_DIR          = "/var/lib/kernelhost"
        KERNELHOST_IMAGE_DIR          = "/var/cache/kernelhost/images"
        KERNELHOST_RUN_DIR            = "/run/kernelhost/vms"
        # shared storage every client mounts here (NFS or the like)
        KERNELHOST_HIBERNATE_DIR = "/mnt/kernelhost-hibernate"
      }

      template {
        destination = "secrets/kernelhost.env"
        env         = true
        data        = <<EOT
{{ with nomadVar "nomad/jobs/kernelhost" }}
KERNELHOST_STORE_URL={{ .store_url }}
KERNELHOST_CLUSTER_SECRET={{ .cluster_secret }}
KERNELHOST_API_KEYS={{ .api_keys }}
{{ end }}
EOT
      }

      service {
        name     = "kernelhost"
        port     = "http"
        provider = "nomad"

        check {
          type     = "http"
          path     = "/healthz"
          interval = "10s"
          timeout  = "5s"
        }
      }

      resources {
        cpu    = 2000
        memory = 4096
      }
    }
  }
}
