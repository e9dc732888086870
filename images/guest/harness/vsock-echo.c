/* Guest-side vsock test helper for the VM harness (runs in the L2 test guest).
 *   vsock-echo listen PORT       accept one connection on PORT, echo it back until EOF
 *   vsock-echo connect PORT MSG  connect to the host (CID 2) PORT, send MSG, print the reply
 *   vsock-echo send PORT         connect to the host (CID 2) PORT, send stdin as it comes, then
 *                                shut down the write side and wait for the host to close
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/socket.h>
#include <linux/vm_sockets.h>

static int die(const char *what) { perror(what); return 1; }

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: vsock-echo listen PORT | connect PORT MSG | send PORT\n"); return 2; }
    struct sockaddr_vm a = { .svm_family = AF_VSOCK, .svm_port = (unsigned)atoi(argv[2]) };
    int s = socket(AF_VSOCK, SOCK_STREAM, 0);
    if (s < 0) return die("socket");
    char buf[65536];
    if (strcmp(argv[1], "listen") == 0) {
        a.svm_cid = VMADDR_CID_ANY;
        if (bind(s, (struct sockaddr *)&a, sizeof a) < 0) return die("bind");
        if (listen(s, 4) < 0) return die("listen");
        printf("vessel-event: vsock-listening\n");
        fflush(stdout);
        int c = accept(s, NULL, NULL);
        if (c < 0) return die("accept");
        ssize_t n;
        while ((n = read(c, buf, sizeof buf)) > 0)
            for (ssize_t off = 0; off < n;) {
                ssize_t w = write(c, buf + off, n - off);
                if (w <= 0) return die("write");
                off += w;
            }
        close(c);
        return 0;
    }
    if (strcmp(argv[1], "connect") == 0 && argc >= 4) {
        a.svm_cid = VMADDR_CID_HOST;
        if (connect(s, (struct sockaddr *)&a, sizeof a) < 0) return die("connect");
        size_t len = strlen(argv[3]);
        if (write(s, argv[3], len) != (ssize_t)len) return die("write");
        shutdown(s, SHUT_WR);
        size_t got = 0;
        ssize_t n;
        while (got < sizeof buf - 1 && (n = read(s, buf + got, sizeof buf - 1 - got)) > 0) got += n;
        buf[got] = 0;
        printf("%s\n", buf);
        return 0;
    }
    if (strcmp(argv[1], "send") == 0) {
        a.svm_cid = VMADDR_CID_HOST;
        if (connect(s, (struct sockaddr *)&a, sizeof a) < 0) return die("connect");
        ssize_t n;
        while ((n = read(0, buf, sizeof buf)) > 0)
            for (ssize_t off = 0; off < n;) {
                ssize_t w = write(s, buf + off, n - off);
                if (w <= 0) return die("write");
                off += w;
            }
        shutdown(s, SHUT_WR);
        while (read(s, buf, sizeof buf) > 0) {}
        return 0;
    }
    fprintf(stderr, "usage: vsock-echo listen PORT | connect PORT MSG | send PORT\n");
    return 2;
}
