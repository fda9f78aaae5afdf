/* powercut: an LD_PRELOAD shim that records what a process made durable, so a test can
 * rebuild the files a power cut would have left (tests/support/powercut/__init__.py).
 *
 * Under POWERCUT_ROOT, every fsync/fdatasync that succeeds is journaled to POWERCUT_LOG:
 *   - of a regular file: a copy of its content at that moment ("F <ino> <seq>", data/<seq>);
 *   - of a directory: its entries at that moment ("D <path>", then "E <kind> <ino> <name>"
 *     per entry, kind f/d/l, a link's target as "T <target>", closed by ".").
 * Nothing else is recorded: a write that was never synced is, after the cut, as if it had
 * never happened. That is the strict model of a disk that honours fsync and nothing more
 * (what SQLite's crash-test VFS and CrashMonkey assume). sync() and syncfs() are refused
 * loudly, since the model could not say what they made durable.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long seq;

static int (*real_fsync)(int);
static int (*real_fdatasync)(int);

static void write_all(int fd, const char *buf, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, buf, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            abort();
        }
        buf += w;
        n -= (size_t)w;
    }
}

static int journal_open(void) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/journal", getenv("POWERCUT_LOG"));
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) abort();
    return fd;
}

static void journal(const char *line) {
    int fd = journal_open();
    write_all(fd, line, strlen(line));
    close(fd);
}

/* The path behind fd when it lies under POWERCUT_ROOT, else 0. */
static int tracked(int fd, char *path, size_t size) {
    const char *root = getenv("POWERCUT_ROOT");
    char link[64];
    if (!root || !getenv("POWERCUT_LOG")) return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, size - 1);
    if (n < 0) return 0;
    path[n] = 0;
    size_t r = strlen(root);
    return strncmp(path, root, r) == 0 && (path[r] == 0 || path[r] == '/');
}

/* The file's content now, read through a fresh descriptor (fd may be write-only). */
static void copy_content(int fd, unsigned long n) {
    char out_path[PATH_MAX], link[64];
    char buf[1 << 16];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    int in = open(link, O_RDONLY | O_CLOEXEC);
    if (in < 0) abort();
    snprintf(out_path, sizeof out_path, "%s/data/%d-%lu", getenv("POWERCUT_LOG"), (int)getpid(), n);
    int out = open(out_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (out < 0) abort();
    off_t at = 0;
    for (;;) {
        ssize_t got = pread(in, buf, sizeof buf, at);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) abort();
        if (got == 0) break;
        write_all(out, buf, (size_t)got);
        at += got;
    }
    close(out);
    close(in);
}

static void record_dir(const char *path) {
    char line[PATH_MAX + 64], target[PATH_MAX];
    DIR *dir = opendir(path);
    if (!dir) return;
    int fd = journal_open();
    snprintf(line, sizeof line, "D %s\n", path);
    write_all(fd, line, strlen(line));
    struct dirent *d;
    while ((d = readdir(dir)) != NULL) {
        if (!strcmp(d->d_name, ".") || !strcmp(d->d_name, "..")) continue;
        struct stat st;
        if (fstatat(dirfd(dir), d->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue; /* gone since readdir */
        char kind = S_ISDIR(st.st_mode) ? 'd' : S_ISLNK(st.st_mode) ? 'l' : 'f';
        snprintf(line, sizeof line, "E %c %lu %s\n", kind, (unsigned long)st.st_ino, d->d_name);
        write_all(fd, line, strlen(line));
        if (kind == 'l') {
            ssize_t n = readlinkat(dirfd(dir), d->d_name, target, sizeof target - 1);
            target[n < 0 ? 0 : n] = 0;
            snprintf(line, sizeof line, "T %s\n", target);
            write_all(fd, line, strlen(line));
        }
    }
    closedir(dir);
    write_all(fd, ".\n", 2);
    close(fd);
}

static void record(int fd) {
    char path[PATH_MAX], line[PATH_MAX + 64];
    struct stat st;
    if (!tracked(fd, path, sizeof path) || fstat(fd, &st) != 0) return;
    int saved = errno;
    pthread_mutex_lock(&lock);
    if (S_ISDIR(st.st_mode)) {
        record_dir(path);
    } else if (S_ISREG(st.st_mode)) {
        unsigned long n = ++seq;
        copy_content(fd, n);
        snprintf(line, sizeof line, "F %lu %d-%lu\n", (unsigned long)st.st_ino, (int)getpid(), n);
        journal(line);
    }
    pthread_mutex_unlock(&lock);
    errno = saved;
}

int fsync(int fd) {
    if (!real_fsync) real_fsync = dlsym(RTLD_NEXT, "fsync");
    int rc = real_fsync(fd);
    if (rc == 0) record(fd);
    return rc;
}

int fdatasync(int fd) {
    if (!real_fdatasync) real_fdatasync = dlsym(RTLD_NEXT, "fdatasync");
    int rc = real_fdatasync(fd);
    if (rc == 0) record(fd);
    return rc;
}

void sync(void) {
    journal("! sync\n");
    abort();
}

int syncfs(int fd) {
    (void)fd;
    journal("! syncfs\n");
    abort();
}
